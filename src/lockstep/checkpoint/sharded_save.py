"""A sharded checkpoint's part written by every rank: each rank's shards (and its own state of the entries held
rank by rank, rank_part.py) through torch.distributed.checkpoint into the temp directory rank 0 made, its share of the files hashed, and every rank's outcome gathered so that
all raise the same CheckpointError, or rank 0 learns every file's size and sha256 for meta.json.

Blocking saves gather on the run's group (the main thread); background saves run on each rank's writer
thread and gather on the manager's own gloo group, so that their collectives never interleave with
training's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.checkpoint import rank_part, sharded
from lockstep.checkpoint.background import describe_error
from lockstep.checkpoint.directories import StepDirectories
from lockstep.checkpoint.layout import step_dirname
from lockstep.checkpoint.storage import remove_quietly
from lockstep.errors import CheckpointError
from lockstep.runtime import all_gather_object, get_rank, get_world_size


@dataclass
class Part:
    """A save's sharded part: this rank's values for DCP (`shards`), what meta.json says of their entries
    (`described`), and the state's other entries (`rest`, rank 0's files)."""

    shards: dict[str, Any]
    described: dict[str, Any]
    rest: dict[str, Any]


def split(state: Mapping[str, Any]) -> Part | None:
    """`state` cut into its sharded part (models with DTensor parameters and their optimizers, entries held
    rank by rank) and the rest; None when it has no sharded part (rank 0 writes everything)."""
    pairs = sharded.pair_entries(state).sharded
    ranked = rank_part.entries(state)
    if not (pairs or ranked):
        return None
    names = {name for pair in pairs for name in pair.names} | set(ranked)
    return Part(
        shards={**sharded.state_dicts(pairs), **rank_part.state_dicts(ranked, get_rank())},
        described={**sharded.describe(pairs), **rank_part.describe(ranked, get_world_size())},
        rest={name: obj for name, obj in state.items() if name not in names},
    )


def prepare_temp(dirs: StepDirectories, step: int) -> tuple[str, str]:
    """Rank 0: the temp directory of checkpoint `step` made, with its `sharded/` ('ok', path), or
    ('failed', why), for every rank to learn."""
    try:
        temp = dirs.make_temp(step)
        (temp / sharded.SHARDED).mkdir()
    except Exception as exc:
        return ("failed", describe_error(exc))
    return ("ok", str(temp))


def raise_failed_copies(step: int, outcomes: list[Any], failure: BaseException | None, tag: str) -> None:
    """A background save's copies, agreed (each rank's (copy failure or None, rank 0's prepare_temp)): every
    rank raises the same CheckpointError when one failed; rank 0 removes the temp directory it made."""
    for rank, (error, _) in enumerate(outcomes):
        if error is not None:
            made = outcomes[0][1]
            if get_rank() == 0 and made is not None and made[0] == "ok":
                remove_quietly(Path(made[1]))
            raise CheckpointError(
                f"{tag}checkpoint {step_dirname(step)} was not saved: rank {rank}'s copy of its shards "
                f"failed: {error}"
            ) from failure


def temp_or_raise(step: int, made: tuple[str, str] | None, tag: str) -> Path:
    """The temp directory rank 0 made (`made`: ('ok', path) or ('failed', why)); every rank raises alike."""
    if made is None or made[0] != "ok":
        why = made[1] if made else "rank 0 made no directory"
        raise CheckpointError(f"{tag}checkpoint {step_dirname(step)} was not saved: {why}")
    return Path(made[1])


def write_part(
    step: int, shards: dict[str, Any], temp: Path, group: dist.ProcessGroup | None, tag: str
) -> dict[str, Any]:
    """Every rank of `group` (None: the run's): write its shards into `temp/sharded/` and hash its share
    of the files; every rank learns every rank's outcome and raises the same CheckpointError if one
    failed (rank 0 removes the temp directory). The file records of the whole part (rank 0 writes them
    into meta.json)."""
    failure: BaseException | None = None
    records: dict[str, Any] = {}
    rank, world = get_rank(), get_world_size()
    try:
        records = sharded.write(shards, temp / sharded.SHARDED, group, rank, world)
    except (Exception, sharded.CheckpointException) as exc:  # every rank reaches the gather below
        failure = exc
    mine = (None if failure is None else sharded.describe_failure(failure, rank), records)
    if group is None:
        gathered = all_gather_object(mine)
    else:  # a writer thread: a plain collective on the manager's own group
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
    files: dict[str, Any] = {}
    for error, part in gathered:
        if error is not None:
            if rank == 0:
                remove_quietly(temp)
            # blocking: raised on every rank as it is; background: the settle says which checkpoint
            said = f"{tag}checkpoint {step_dirname(step)} was not saved: " if group is None else ""
            raise CheckpointError(f"{said}writing its sharded part failed: {error}") from (
                failure if isinstance(failure, Exception) else None
            )
        files.update(part)
    return files
