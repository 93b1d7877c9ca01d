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
import uuid
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint import layout as paths
from lockstep.checkpoint import rng
from lockstep.checkpoint.background import BackgroundSaves, describe_error
from lockstep.checkpoint.layout import CheckpointLayout, check_entry_name, step_dirname, steps_to_prune
from lockstep.checkpoint.meta import describe, read_meta, validate
from lockstep.checkpoint.serialize import Entry, collect, encode, load_plan
from lockstep.checkpoint.stateful import (
    gather_state,
)
from lockstep.checkpoint.storage import (
    explain_os_error,
    publish_dir,
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

    @property
    def run_dir(self) -> Path:
        return self.layout.run_dir

    def steps(self) -> list[int]:
        """Steps of the checkpoint directories present (valid or not), oldest first."""
        if not self.layout.root.is_dir():
            return []
        found = (paths.parse_step(p.name) for p in self.layout.root.iterdir() if p.is_dir())
        return sorted(s for s in found if s is not None)

    # ---- save -----------------------------------------------------------------------------------------

    @phase(CHECKPOINT)  # the hang watchdog allows a long save on rank 0 (the others wait for it)
    def save(self, step: int, state: Mapping[str, Any], *, blocking: bool = True) -> Path:
        """Write checkpoint `step` from rank 0; returns its directory on every rank.

        blocking=True: the other ranks wait until the checkpoint is complete. blocking=False: rank 0 copies
        the state to CPU memory and writes it on a background thread while training goes on; the next
        save, `wait()` or `load()` waits for that write and raises its failure on every rank (at most one
        write is in flight). Either way a failure leaves the checkpoints already there untouched.
        """
        start = time.monotonic()
        try:
            _check_save(step, state, self._tag())
            for obj in state.values():
                gather_state(obj)  # a sharded optimizer's full state, collected on rank 0 (the writer)
            # Every rank's random streams, to rank 0 (and the rest), in the same collective that settles the
            # background write in flight: a background save stops training for one collective and a copy.
            rngs = self._settle(rng.capture())
            if blocking:
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
        CheckpointError on every rank if it failed."""
        start = time.monotonic()
        try:
            self._settle()
        finally:
            self.stall_s += time.monotonic() - start

    @property
    def cpu_copy_bytes(self) -> int:
        """CPU memory kept for background saves (0 on ranks that do not write, and before the first)."""
        return self.background.snapshot.nbytes

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

    def _write(self, step: int, entries: list[Entry], rngs: list[Any]) -> None:
        blobs, described = encode(entries)
        blobs[paths.RNG] = json.dumps(
            {"version": rng.RNG_VERSION, "world_size": len(rngs), "ranks": rngs}
        ).encode()
        root, final = self.layout.root, self.layout.step_dir(step)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint directory {root} ({exc.strerror}): {explain_os_error(exc)}"
            ) from exc
        self._remove_leftovers()
        token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        temp = self.layout.temp_dir(step, token)
        try:
            temp.mkdir()
            files = {name: write_atomic(temp / name, data).to_json() for name, data in blobs.items()}
            meta = describe(step, len(rngs), described, files)
            write_atomic(temp / paths.META, json.dumps(meta, indent=1).encode())
            publish_dir(temp, final, self.layout.old_dir(step, token))
        except OSError as exc:
            remove_quietly(temp)
            kept = [step_dirname(s) for s in self.steps() if s != step] or ["none"]
            raise CheckpointError(
                f"writing {final} failed ({exc.strerror or exc}: {exc.filename or ''}): {explain_os_error(exc)}; "
                f"the checkpoints already there are untouched: {', '.join(kept[-3:])}"
            ) from exc
        try:
            write_atomic(self.layout.latest, f"{final.name}\n".encode())
        except OSError as exc:  # the checkpoint itself is complete; the pointer is a convenience
            self._log.warning(
                "checkpoint %s is complete but %s could not be updated: %s", final, self.layout.latest, exc
            )
        self._prune(step)
        self._log.info("checkpoint saved: %s", final)

    def _remove_leftovers(self) -> None:
        self._recover_replaced()
        for path in self.layout.root.iterdir():
            if self.layout.is_leftover(path.name):
                remove_quietly(path)

    def _recover_replaced(self) -> None:
        """A save that died between moving a step aside and publishing its replacement: move it back."""
        for path in self.layout.root.iterdir():
            step = self.layout.replaced_step(path.name)
            if step is not None and not self.layout.step_dir(step).exists():
                os.rename(path, self.layout.step_dir(step))
                self._log.warning("recovered %s, left aside by an interrupted save", step_dirname(step))

    def _prune(self, saved: int) -> None:
        steps = self.steps()
        newer = [s for s in steps if s > saved]
        if newer:  # only reachable after resuming from an older checkpoint: those belong to an abandoned run
            self._log.warning(
                "removing checkpoints newer than the one just saved (%s): %s",
                step_dirname(saved),
                ", ".join(step_dirname(s) for s in newer),
            )
        for old in newer + steps_to_prune([s for s in steps if s <= saved], self.keep):
            remove_quietly(self.layout.step_dir(old))

    # ---- load -----------------------------------------------------------------------------------------

    def load(self, state: MutableMapping[str, Any], *, required: bool = False) -> int | None:
        """Load the newest valid checkpoint into `state` on every rank; its step, or None when there is none.

        With required=True, finding no usable checkpoint raises CheckpointError instead of returning None.
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
        failure: BaseException | None = None
        try:
            self._apply(step, state)
        except Exception as exc:
            failure = exc
        errors = all_gather_object(None if failure is None else describe_error(failure))
        mine = errors[get_rank()]
        if mine is not None:
            raise CheckpointError(f"{self._tag()}{mine}") from failure
        for rank, error in enumerate(errors):
            if error is not None:
                raise CheckpointError(
                    f"{self._tag()}loading {step_dirname(step)} failed on rank {rank}: {error}"
                )
        self._log.info("resumed from checkpoint %s", self.layout.step_dir(step))
        return step

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
        self._recover_replaced()
        for step in reversed(self.steps()):
            problem = validate(self.layout.step_dir(step), step)
            if problem is None:
                if skipped:
                    self._log.warning(
                        "skipping unusable checkpoints (%s); resuming from the previous one, %s",
                        "; ".join(skipped),
                        step_dirname(step),
                    )
                return {"step": step, "why": ""}
            skipped.append(f"{step_dirname(step)}: {problem}")
        if skipped:
            self._log.warning("no usable checkpoint in %s: %s", root, "; ".join(skipped))
            return {"step": None, "why": f"every checkpoint in {root} is unusable: {'; '.join(skipped)}"}
        return {"step": None, "why": f"{root} holds no checkpoint"}

    def _apply(self, step: int, state: MutableMapping[str, Any]) -> None:
        directory = self.layout.step_dir(step)
        meta = read_meta(directory)
        for name, record in meta["files"].items():  # rank 0 checked sha256; here: is it there at all?
            path = directory / name
            if not path.is_file() or path.stat().st_size != record["bytes"]:
                raise CheckpointError(
                    f"{path} is missing or has another size than on rank 0: is run_dir on a "
                    "file system that every rank sees?"
                )
        entries: dict[str, Any] = meta["entries"]
        absent = [name for name in state if name not in entries]
        if absent:
            raise CheckpointError(
                f"checkpoint {directory} has no entry {absent!r} (it has {sorted(entries)!r}); "
                "load with the same state names it was saved with, or start a fresh run_dir"
            )
        extra = sorted(set(entries) - set(state))
        if extra and get_rank() == 0:
            self._log.warning(
                "checkpoint %s also holds %s, which this state does not ask for", directory, extra
            )
        plan = load_plan(directory, entries, state)
        for name, target, loaded in plan:
            if target is None:
                state[name] = loaded
                continue
            try:
                target.load_state_dict(loaded)
            except Exception as exc:
                raise CheckpointError(
                    f"checkpoint {directory}: state[{name!r}] ({type(target).__name__}) rejected "
                    f"its saved state: {type(exc).__name__}: {exc}"
                ) from exc
        self._restore_rng(directory, step, int(meta["world_size"]))

    def _restore_rng(self, directory: Path, step: int, saved_world: int) -> None:
        saved = json.loads((directory / paths.RNG).read_text())["ranks"]
        rank, world = get_rank(), get_world_size()
        if rank < len(saved):
            rng.restore(saved[rank])
        else:
            seed = rng.seed_new_rank(step, rank)
            self._log.warning(
                "checkpoint %s was written by %d ranks and has no RNG state for rank %d: its "
                "generators are seeded with %d (from step and rank)",
                directory.name,
                saved_world,
                rank,
                seed,
            )
        if saved_world != world and rank == 0:
            self._log.info(
                "resuming %s, written by %d ranks, on %d ranks", directory.name, saved_world, world
            )

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
