"""`CheckpointManager`: rank 0 writes atomic, checksummed checkpoints; every rank loads the newest valid one.

save(step, state) and load(state) are collectives: every rank calls them at the same point, and the
waiting happens inside (there is no barrier for the user to forget). A failure on the writer (disk full,
read-only directory, an entry torch.load(weights_only=True) could not read back) is sent to every
rank, which all raise the same CheckpointError instead of leaving the others waiting. Loading checks
each file against meta.json's sha256 on rank 0 and falls back to the previous checkpoint, with a
warning, when the newest is partial or damaged; every rank then loads that same step onto its own
devices, and all ranks agree on success before any returns.

Resuming at another world size: models, optimizers and the sampler's global position load unchanged;
RNG streams are restored for ranks that existed, and ranks that did not get streams seeded from
(step, rank) with a warning (reproducible, not identical to any earlier rank).

For a bitwise resume, give the DataLoader a generator of its own (`generator=torch.Generator()`):
otherwise each iter(loader) draws its workers' base seed from the global torch RNG, and a resumed run
calls iter() at another step than the uninterrupted one, shifting every later random draw.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint import layout as paths
from lockstep.checkpoint import loading, rng, sharded, sharded_save
from lockstep.checkpoint.background import BackgroundSaves, ShardedWrites, describe_error
from lockstep.checkpoint.directories import StepDirectories
from lockstep.checkpoint.layout import CheckpointLayout, check_entry_name, step_dirname
from lockstep.checkpoint.meta import describe, read_meta, validate
from lockstep.checkpoint.serialize import Entry, collect, encode
from lockstep.checkpoint.stateful import (
    gather_state,
)
from lockstep.checkpoint.storage import (
    explain_os_error,
    remove_quietly,
    write_atomic,
)
from lockstep.errors import CheckpointError, ConfigError, rank_tag
from lockstep.runtime import all_gather_object, broadcast_object, get_logger, get_rank, get_world_size
from lockstep.runtime.progress import CHECKPOINT, phase


class CheckpointManager:
    """Checkpoints of a run under `run_dir/checkpoints/step_NNNNNN/`, keeping the newest `keep`.

    `state` maps names to objects with state_dict()/load_state_dict() (model, optimizer, scheduler,
    GradScaler, sampler; a wrapped model or a replicate handle too) or to plain values (numbers,
    strings, lists, dicts, tensors), which load() puts back into the mapping.
    """

    def __init__(self, run_dir: str | os.PathLike[str], keep: int = 3) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"keep must be an int >= 1 (checkpoints to retain), got {keep!r}")
        self.layout = CheckpointLayout(Path(run_dir))
        self.keep = keep
        self._log = get_logger("lockstep.checkpoint")
        self.stall_s = 0.0  # seconds this rank spent blocked in save() and wait(), background or not
        self.written = 0  # checkpoints known complete on every rank
        self.background = BackgroundSaves(self._log)  # the CPU copy and the write in flight
        self.dirs = StepDirectories(self.layout, keep, self._log)  # rank 0's temp dirs, leftovers, pruning
        self.sharded_writes = ShardedWrites(self.background)  # their gloo group; live mode's abandoned ones

    @property
    def run_dir(self) -> Path:
        return self.layout.run_dir

    def steps(self) -> list[int]:
        """Steps of the checkpoint directories present (valid or not), oldest first."""
        return self.dirs.steps()

    # ---- save -----------------------------------------------------------------------------------------

    @phase(CHECKPOINT)  # the hang watchdog allows a long save on rank 0 (the others wait for it)
    def save(self, step: int, state: Mapping[str, Any], *, blocking: bool = True) -> Path:
        """Write checkpoint `step` from rank 0; returns its directory on every rank.

        blocking=True: the other ranks wait until the checkpoint is complete. blocking=False: rank 0 copies
        the state to CPU memory and writes it on a background thread while training goes on; the next
        save, `wait()` or `load()` waits for that write and raises its failure on every rank (at most one
        write is in flight). Either way a failure leaves the checkpoints already there untouched.

        A model whose parameters are DTensors (FSDP2, HSDP) and its optimizer are written by every rank, each
        its own shards, into the checkpoint's `sharded/` directory (see checkpoint/sharded.py), and so is an
        entry held rank by rank (a RankStateful: each rank's own state, checkpoint/rank_part.py); rank 0
        publishes the checkpoint once every rank's part is written. In the background, every rank copies its
        shards to CPU memory and writes them on a thread, over a gloo group of the manager's own.
        """
        start = time.monotonic()
        try:
            _check_save(step, state, self._tag())
            _check_sharded(state, self._tag())
            for obj in state.values():
                gather_state(obj)  # a sharded optimizer's full state, collected on rank 0 (the writer)
            # Every rank's random streams, to rank 0 (and the rest), in the same collective that settles the
            # background write in flight: a background save stops training for one collective and a copy.
            rngs = self._settle(rng.capture())
            part = sharded_save.split(state)  # sharded models and optimizers, entries held rank by rank
            if part is not None:
                self._save_sharded(step, part, rngs, blocking)
            elif blocking:
                self._agree(step, self._on_writer(lambda: self._write(step, collect(state), rngs)))
                self.written += 1
            else:
                # The copy's failure is not agreed on now (that would be one more collective): the next
                # settle (a save, wait() or load()) raises it on every rank, as a failed write.
                taken: list[list[Entry]] = []
                failure = self._on_writer(lambda: taken.append(self.background.copy(collect(state))))
                write = (lambda: self._write(step, taken[0], rngs)) if taken else None
                self.background.start(step, write, failure)
            return self.layout.step_dir(step)
        finally:
            self.stall_s += time.monotonic() - start

    @phase(CHECKPOINT)
    def wait(self) -> None:
        """Wait for the background write in flight, if any (every rank calls it, e.g. at the end of a run);
        CheckpointError on every rank if it failed. A collective whether or not this rank knows of a write
        in flight: in live mode a replacement does not know of one started before it joined."""
        start = time.monotonic()
        try:
            self._settle(payload=0)
        finally:
            self.stall_s += time.monotonic() - start

    @property
    def cpu_copy_bytes(self) -> int:
        """CPU memory kept for background saves (0 on ranks that do not write, and before the first; a sharded
        run's ranks each keep a copy of their shards)."""
        return self.background.snapshot.nbytes + self.background.shards.nbytes

    def _on_writer(self, work: Any) -> BaseException | None:
        """Run `work` on rank 0; its exception (to be sent to every rank by _agree), or None."""
        if get_rank() != 0:
            return None
        try:
            work()
        except Exception as exc:  # reported to every rank, so that nobody waits forever
            return exc
        return None

    def _agree(self, step: int, failure: BaseException | None) -> None:
        """Every rank learns rank 0's outcome for checkpoint `step` and raises the same error on failure."""
        message = broadcast_object(None if failure is None else describe_error(failure))
        if message is not None:
            raise CheckpointError(
                f"{self._tag()}checkpoint {step_dirname(step)} was not saved: {message}"
            ) from failure

    def _settle(self, payload: Any = None) -> list[Any]:
        """Collect the background write in flight, if any (a collective on every rank, pending or not), and
        gather every rank's `payload` with it; the payloads in rank order."""
        completed, payloads = self.background.settle(self.layout.step_dir, self._tag(), payload)
        if completed:
            self.written += 1
        return payloads

    # ---- the sharded part (checkpoint/sharded.py) -------------------------------------------------------

    def _save_sharded(self, step: int, part: sharded_save.Part, rngs: list[Any], blocking: bool) -> None:
        """Every rank writes its shards of the part's models and optimizers, and its own state of the entries
        held rank by rank (checkpoint/rank_part.py), into the temp directory rank 0 made; rank 0 then writes
        the other entries and meta.json there and publishes it (blocking: now, else on the writer threads,
        settled as any background write)."""
        rest, described, shards = part.rest, part.described, part.shards
        if blocking:
            made = broadcast_object(sharded_save.prepare_temp(self.dirs, step) if get_rank() == 0 else None)
            temp = sharded_save.temp_or_raise(step, made, self._tag())
            files = sharded_save.write_part(step, shards, temp, None, self._tag())
            self._agree(
                step,
                self._on_writer(lambda: self._write(step, collect(rest), rngs, temp, (described, files))),
            )
            self.written += 1
            return
        group = self.sharded_writes.gloo_group()
        failure: BaseException | None = None
        copy: dict[str, Any] = {}
        taken: list[list[Entry]] = []
        made = None
        try:
            copy = self.background.copy_shards(shards)  # every rank: its shards, in CPU memory
            if get_rank() == 0:
                taken.append(self.background.copy(collect(rest)))
        except Exception as exc:
            failure = exc
        if get_rank() == 0 and failure is None:
            made = sharded_save.prepare_temp(self.dirs, step)
        outcomes = all_gather_object((None if failure is None else describe_error(failure), made))
        sharded_save.raise_failed_copies(step, outcomes, failure, self._tag())
        temp = sharded_save.temp_or_raise(step, outcomes[0][1], self._tag())
        self.sharded_writes.in_flight = temp

        def write_part() -> None:
            sharded_save.write_part(step, copy, temp, group, "")

        def write_all() -> None:
            files = sharded_save.write_part(step, copy, temp, group, "")
            self._write(step, taken[0], rngs, temp, (described, files))

        self.background.start(step, write_all if get_rank() == 0 else write_part)

    def reshard(self, topology: object) -> None:
        """Live mode, after the group changed (a loss or a growth; `topology`: this rank's place in the new
        one): a sharded background write in flight is abandoned (it can never publish; the next settle
        judges what reached the disk), and the next one makes its gloo group over the new group."""
        self.sharded_writes.regroup()

    def _write(
        self,
        step: int,
        entries: list[Entry],
        rngs: list[Any],
        temp: Path | None = None,
        part: tuple[dict[str, Any], dict[str, Any]] | None = None,
    ) -> None:
        """Rank 0: write the checkpoint's files and publish it. `temp`: the directory made for it, which
        already holds the sharded `part` (what meta.json says of its entries, and its files' records)."""
        blobs, described = encode(entries)
        blobs[paths.RNG] = json.dumps(
            {"version": rng.RNG_VERSION, "world_size": len(rngs), "ranks": rngs}
        ).encode()
        final = self.layout.step_dir(step)
        try:
            if temp is None:
                temp = self.dirs.make_temp(step)
            old = self.dirs.old_dir(step, temp)
            files = {name: write_atomic(temp / name, data).to_json() for name, data in blobs.items()}
            if part is not None:
                described = {**described, **part[0]}
                files.update(part[1])
            meta = describe(step, len(rngs), described, files, sharded=part is not None)
            write_atomic(temp / paths.META, json.dumps(meta, indent=1).encode())
            with self.sharded_writes.publishing(temp) as allowed:
                if not allowed:  # abandoned when the group changed: what it left is judged on disk
                    remove_quietly(temp)
                    return
                self.dirs.publish(step, temp, old)
        except OSError as exc:
            if temp is not None:
                remove_quietly(temp)
            kept = [step_dirname(s) for s in self.steps() if s != step] or ["none"]
            raise CheckpointError(
                f"writing {final} failed ({exc.strerror or exc}: {exc.filename or ''}): {explain_os_error(exc)}; "
                f"the checkpoints already there are untouched: {', '.join(kept[-3:])}"
            ) from exc

    # ---- load -----------------------------------------------------------------------------------------

    def load(
        self,
        state: MutableMapping[str, Any],
        *,
        required: bool = False,
        optional: frozenset[str] = frozenset(),
    ) -> int | None:
        """Load the newest valid checkpoint into `state` on every rank; its step, or None when there is none.

        With required=True, finding no usable checkpoint raises CheckpointError instead of returning None.
        `optional`: entries of `state` that a checkpoint saved before they existed lacks (left as they are).
        """
        self._settle()  # a background write of this manager's first: load what it wrote
        choice = broadcast_object(self._choose_safely() if get_rank() == 0 else None)
        step = choice["step"]
        if choice.get("failed"):
            raise CheckpointError(f"{self._tag()}cannot look for checkpoints: {choice['why']}")
        if step is None:
            if required:
                raise CheckpointError(f"{self._tag()}no checkpoint to resume from: {choice['why']}")
            self._log.info("no checkpoint to resume from (%s): starting from scratch", choice["why"])
            return None
        # A sharded part, or a sharded model in the state, loads through collectives (DCP's, and torch's
        # set_state_dict): every rank agrees that its checks passed before any enters them.
        collective = bool(choice.get("sharded")) or bool(sharded.pair_entries(state).sharded)
        failure: BaseException | None = None
        reading: loading.Loading | None = None
        try:
            reading = loading.prepare(self.layout.step_dir(step), step, state, self._log, optional)
        except Exception as exc:
            failure = exc
        if collective:
            self._agree_load(step, failure)
        if reading is not None and failure is None:
            try:
                loading.apply(reading, state, self._log)
            except Exception as exc:
                failure = exc
        self._agree_load(step, failure)
        self._log.info("resumed from checkpoint %s", self.layout.step_dir(step))
        return step

    def _agree_load(self, step: int, failure: BaseException | None) -> None:
        """Every rank learns whether loading `step` failed anywhere, and raises if so."""
        errors = all_gather_object(None if failure is None else describe_error(failure))
        mine = errors[get_rank()]
        if mine is not None:
            raise CheckpointError(f"{self._tag()}{mine}") from failure
        for rank, error in enumerate(errors):
            if error is not None:
                raise CheckpointError(
                    f"{self._tag()}loading {step_dirname(step)} failed on rank {rank}: {error}"
                )

    def _choose_safely(self) -> dict[str, Any]:
        try:
            return self._choose()
        except Exception as exc:  # sent to every rank: the others are waiting for rank 0's choice
            return {"step": None, "failed": True, "why": f"{self.layout.root}: {describe_error(exc)}"}

    def _choose(self) -> dict[str, Any]:
        root = self.layout.root
        if not root.is_dir():
            missing = root if self.run_dir.is_dir() else self.run_dir
            return {"step": None, "why": f"{missing} does not exist"}
        skipped: list[str] = []
        self.dirs.recover_replaced()
        for step in reversed(self.steps()):
            problem = validate(self.layout.step_dir(step), step)
            if problem is None:
                if skipped:
                    self._log.warning(
                        "skipping unusable checkpoints (%s); resuming from the previous one, %s",
                        "; ".join(skipped),
                        step_dirname(step),
                    )
                has_part = bool(read_meta(self.layout.step_dir(step)).get("sharded"))
                return {"step": step, "why": "", "sharded": has_part}
            skipped.append(f"{step_dirname(step)}: {problem}")
        if skipped:
            self._log.warning("no usable checkpoint in %s: %s", root, "; ".join(skipped))
            return {"step": None, "why": f"every checkpoint in {root} is unusable: {'; '.join(skipped)}"}
        return {"step": None, "why": f"{root} holds no checkpoint"}

    def _tag(self) -> str:
        world = get_world_size()
        return rank_tag(get_rank(), world) if world > 1 else ""


def _check_save(step: int, state: Mapping[str, Any], tag: str) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"{tag}save expects an int step >= 0, got {step!r}")
    if not isinstance(state, Mapping):
        raise ConfigError(f"{tag}save expects a dict of name -> object, got {type(state).__name__}")
    for name in state:
        check_entry_name(name)


def _check_sharded(state: Mapping[str, Any], tag: str) -> None:
    pairs = sharded.pair_entries(state)
    lone = sharded.unpaired_optimizer(state, pairs)
    if lone is not None:
        raise ConfigError(
            f"{tag}state[{lone!r}] is an optimizer of DTensor parameters (a sharded model) whose model is not "
            "in the state: checkpoint them together (its state is keyed by the model's parameter names)"
        )
