"""What a load reads and checks (prepare), then puts into the state's objects (apply), on every rank.

Replicated entries (rank 0's files) load as they always have. A checkpoint's sharded part (sharded.py) is read
through torch.distributed.checkpoint into the layout of the state's models, whatever it is: another mesh, HSDP,
or a plain replicated model, which reads whole tensors. A replicated checkpoint's model and optimizer load into
a sharded model whole: the optimizer's index keys are named after the model's parameters, and torch's
set_state_dict(..., full_state_dict=True) keeps this rank's shards. An entry held rank by rank (rank_part.py)
is read by each rank from its own key, in the same read, at the layout it was saved at only, and loaded after
the models and optimizers (its state overrides theirs). Every check runs before anything changes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint import layout as paths
from lockstep.checkpoint import rank_part, rng, sharded
from lockstep.checkpoint.meta import read_meta
from lockstep.checkpoint.serialize import load_plan
from lockstep.errors import CheckpointError
from lockstep.runtime import get_rank, get_world_size


class Loading:
    """What a load read and checked (prepare), to be put into the objects (apply)."""

    def __init__(self, directory: Path, step: int, world_size: int) -> None:
        self.directory, self.step, self.world_size = directory, step, world_size
        self.plan: list[tuple[str, Any, Any]] = []  # replicated entries, loaded as always
        self.whole: dict[
            str, list[Any]
        ] = {}  # model entry: [pair, full model state, FQN-keyed optimizer state]
        self.part: list[sharded.Pair] = []  # pairs loaded from the sharded part (DCP)
        self.template: dict[str, Any] = {}  # their current states: the layout DCP reads into
        self.ranked: dict[str, Any] = {}  # entries held rank by rank (rank_part.py): this rank's own state


def _part_pairs(
    directory: Path, names: list[str], pairs: sharded.Pairs, entries: dict[str, Any]
) -> list[sharded.Pair]:
    """The state's pairs whose entries the sharded part holds; a CheckpointError when the state pairs them
    otherwise than the checkpoint did."""
    found: list[sharded.Pair] = []
    for name in names:
        pair = pairs.of(name)
        model = entries[name].get("model", name)
        if pair is None or pair.model_name != model or model not in names:
            raise CheckpointError(
                f"checkpoint {directory} holds state[{name!r}] in its sharded part with the model "
                f"state[{model!r}]: load it into an optimizer of that model's parameters, with the model"
            )
        if pair not in found:
            found.append(pair)
    return found  # an optimizer not in the state is not read: its model loads alone


def _set(
    directory: Path, name: str, pair: sharded.Pair, model_state: Any, optimizer_state: Any, *, full: bool
) -> None:
    try:
        sharded.apply(pair, model_state, optimizer_state, full=full)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {directory}: state[{name!r}] rejected its saved state: {type(exc).__name__}: {exc}"
        ) from exc


def _load_own(directory: Path, name: str, target: Any, state: dict[str, Any]) -> None:
    try:
        target.load_state_dict(state)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {directory}: state[{name!r}] ({type(target).__name__}) rejected this rank's saved "
            f"state: {type(exc).__name__}: {exc}"
        ) from exc


def prepare(
    directory: Path,
    step: int,
    state: MutableMapping[str, Any],
    log: logging.Logger,
    optional: frozenset[str] = frozenset(),
) -> Loading:
    """Read and check what checkpoint `step` (in `directory`) holds for `state`; raises before anything is
    changed. Entries named in `optional` that the checkpoint lacks (one saved before they existed) are
    left as they are."""
    meta = read_meta(directory)
    for name, record in meta["files"].items():  # rank 0 checked sha256; here: is it there at all?
        path = directory / name
        if not path.is_file() or path.stat().st_size != record["bytes"]:
            raise CheckpointError(
                f"{path} is missing or has another size than on rank 0: is run_dir on a "
                "file system that every rank sees?"
            )
    entries: dict[str, Any] = meta["entries"]
    state = {name: obj for name, obj in state.items() if name in entries or name not in optional}
    absent = [name for name in state if name not in entries]
    if absent:
        raise CheckpointError(
            f"checkpoint {directory} has no entry {absent!r} (it has {sorted(entries)!r}); "
            "load with the same state names it was saved with, or start a fresh run_dir"
        )
    extra = sorted(set(entries) - set(state))
    if extra and get_rank() == 0:
        log.warning("checkpoint %s also holds %s, which this state does not ask for", directory, extra)
    pairs = sharded.pair_entries(state)
    lone = sharded.unpaired_optimizer(state, pairs)
    if lone is not None:
        raise CheckpointError(
            f"state[{lone!r}] is an optimizer of DTensor parameters whose model is not in the state: "
            "load them together (its state is keyed by the model's parameter names)"
        )
    from_part = [n for n in state if entries[n].get("kind") == sharded.SHARDED]
    loading = Loading(directory, step, int(meta["world_size"]))
    loading.part = _part_pairs(directory, from_part, pairs, entries)
    if loading.part:
        shapes = sharded.saved_shapes(directory)
        for pair in loading.part:
            if pair.optimizer is not None and pair.optimizer_name in from_part:
                model_state, optimizer_state = sharded.get_state_dict(pair.module, pair.optimizer)
                loading.template[pair.optimizer_name or ""] = optimizer_state
            else:
                model_state = sharded.get_model_state_dict(pair.module)
            sharded.check_model(directory, pair.model_name, model_state, shapes)
            loading.template[pair.model_name] = model_state
    # Entries held rank by rank: this rank reads its own state, in the same DCP read as the sharded part
    from_ranks = [n for n in state if entries[n].get("kind") == rank_part.PER_RANK]
    for name in from_ranks:
        loading.ranked[name] = rank_part.check(directory, name, state[name], entries[name])
        loading.template[rank_part.key(name, get_rank())] = None  # a value stored whole (not a tensor)
    # A replicated checkpoint's entries (rank 0's files): read and checked as always; a sharded model and
    # its optimizer then take them whole (the optimizer's index keys named after the parameters).
    rest = {n: state[n] for n in state if n not in from_part and n not in from_ranks}
    whole = {p.model_name: p for p in pairs.sharded if p.model_name in rest}
    whole.update({p.optimizer_name: p for p in whole.values() if p.optimizer_name in rest})
    for name, target, loaded in load_plan(directory, entries, rest):
        if name not in whole:
            loading.plan.append((name, target, loaded))
            continue
        pair = whole[name]
        if name == pair.model_name:
            loading.whole.setdefault(name, [pair, None, None])[1] = loaded
        else:
            named = sharded.named_optimizer_state(loaded, pair, directory)
            loading.whole.setdefault(pair.model_name, [pair, None, None])[2] = named
    for name, (pair, model_state, _) in loading.whole.items():
        if model_state is None:
            raise CheckpointError(
                f"checkpoint {directory}: state[{pair.optimizer_name!r}] (the optimizer of a sharded "
                f"model) loads with its model, state[{name!r}]: ask for both"
            )
    return loading


def apply(loading: Loading, state: MutableMapping[str, Any], log: logging.Logger) -> None:
    """Put what prepare() read into the state's objects (every rank; collectives where sharded)."""
    directory = loading.directory
    # The sharded entries first: they are collectives, which every rank must reach; a local entry that a rank
    # rejects afterwards raises there, and the ranks meet again only in the load's agreement.
    for name, (pair, model_state, optimizer_state) in loading.whole.items():
        _set(directory, name, pair, model_state, optimizer_state, full=True)
    if loading.template:
        loaded = sharded.read(directory, loading.template)
        for pair in loading.part:
            optimizer_state = loaded.get(pair.optimizer_name or "")
            _set(directory, pair.model_name, pair, loaded[pair.model_name], optimizer_state, full=False)
        # after the models and optimizers: a rank's own state overrides what the part's shared shards gave
        for name, target in loading.ranked.items():
            _load_own(directory, name, target, rank_part.unpack(directory, name, get_rank(), loaded))
    for name, target, loaded_state in loading.plan:
        if target is None:
            state[name] = loaded_state
            continue
        try:
            target.load_state_dict(loaded_state)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {directory}: state[{name!r}] ({type(target).__name__}) rejected "
                f"its saved state: {type(exc).__name__}: {exc}"
            ) from exc
    _restore_rng(directory, loading.step, loading.world_size, log)


def _restore_rng(directory: Path, step: int, saved_world: int, log: logging.Logger) -> None:
    saved = json.loads((directory / paths.RNG).read_text())["ranks"]
    rank, world = get_rank(), get_world_size()
    if rank < len(saved):
        rng.restore(saved[rank])
    else:
        seed = rng.seed_new_rank(step, rank)
        log.warning(
            "checkpoint %s was written by %d ranks and has no RNG state for rank %d: its "
            "generators are seeded with %d (from step and rank)",
            directory.name,
            saved_world,
            rank,
            seed,
        )
    if saved_world != world and rank == 0:
        log.info("resuming %s, written by %d ranks, on %d ranks", directory.name, saved_world, world)
