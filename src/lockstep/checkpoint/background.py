"""Checkpoints written on a thread of the writer rank while training goes on (one write at a time).

A sharded run's checkpoint has a thread on every rank: each writes its own shards (from its CPU copy) over
the manager's gloo group, and the writer rank's then writes the rest and publishes the checkpoint.

The thread encodes and writes a snapshot (snapshot.py) with the same atomic layout as a blocking save. Its
outcome is collected by the next save, by `CheckpointManager.wait()` or by a load, which all ranks call:
a failure is raised there on every rank, naming the file, and logged on the writer as soon as it happens,
so that it is never silent. The thread is not a daemon: a process that ends without waiting still
finishes the write before it exits (but for one abandoned in live mode, whose process ends with os._exit).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lockstep.checkpoint.layout import step_dirname
from lockstep.checkpoint.meta import validate
from lockstep.checkpoint.serialize import Entry
from lockstep.checkpoint.snapshot import CpuSnapshot, ShardSnapshot
from lockstep.errors import CheckpointError
from lockstep.runtime import all_gather_object, get_rank


class BackgroundWrite:
    """One write of checkpoint `step` running `write` on its own thread."""

    def __init__(self, step: int, write: Callable[[], None], log: logging.Logger) -> None:
        self.step = step
        self._write, self._log = write, log
        self._failure: BaseException | None = None
        self.abandoned = False  # live mode: let go when the group changed (its failure is expected then)
        self._thread = threading.Thread(target=self._run, name=f"lockstep-checkpoint-{step}", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as exc:  # collected by join(); logged now in case nobody asks again
            self._failure = exc
            if self.abandoned:
                self._log.info("abandoned background checkpoint of step %d ended: %s", self.step, exc)
                return
            self._log.error(
                "background checkpoint of step %d failed: %s (raised on every rank at the next save or "
                "wait(); in live mode, dropped instead if the group changed under it)",
                self.step,
                exc,
            )

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> BaseException | None:
        """Wait for the write; its exception, or None when the checkpoint is complete."""
        self._thread.join()
        return self._failure


class BackgroundSaves:
    """A manager's background saves: its CPU copy (snapshot.py) and the one write in flight, settled by all."""

    def __init__(self, log: logging.Logger) -> None:
        self.snapshot = CpuSnapshot()  # reused from save to save
        self.shards = ShardSnapshot()  # a sharded run's: this rank's shards (every rank)
        self._log = log
        self._pending: int | None = None  # the step of a write not yet settled (every rank knows it)
        self._writing: BackgroundWrite | _Failed | None = None  # ... and its thread (the writer rank)
        self._abandoned = False  # live mode: the pending write was let go when the group changed

    def abandon(self) -> int | None:
        """Live mode, the group changed under a sharded write: its collectives ran over the old group, which
        is gone, so its threads may never end, and a failure of theirs is the change's, not the disk's. They
        are let go unjoined (the process ends with os._exit); the step stays pending, and the next settle
        keeps the checkpoint only if it reached the disk whole before, as it does one whose writer is gone.
        Returns that step (the manager never lets the abandoned write publish), None when none was in
        flight. A thread still running gets new CPU copies made for the next save: it may read its own."""
        writing = self._writing
        if writing is None:
            return None
        self._writing, self._abandoned = None, True
        if isinstance(writing, BackgroundWrite):
            writing.abandoned = True
            if writing.running:
                self.snapshot, self.shards = CpuSnapshot(), ShardSnapshot()
        return self._pending

    def copy(self, entries: list[Entry]) -> list[Entry]:
        """The entries in this manager's CPU copy (the writer rank, at the step boundary)."""
        return self.snapshot.take(entries)

    def copy_shards(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's shards of a sharded run's models and optimizers in CPU memory (every rank)."""
        return self.shards.take(state)

    def start(
        self, step: int, write: Callable[[], None] | None, failure: BaseException | None = None
    ) -> None:
        """Every rank: checkpoint `step` is being written; the writer rank passes the write to run, or the
        failure that stopped it from starting (its copy failed), which the next settle raises on every rank.
        In a sharded run every rank passes a write (its shards); the other ranks' outcomes reach the writer
        rank's (a gather on the manager's group), which decides."""
        self._pending = step
        if failure is not None:
            self._writing = _Failed(failure)
        elif write is not None:
            self._writing = BackgroundWrite(step, write, self._log)

    def settle(
        self, step_dir: Callable[[int], Path], tag: str, payload: Any = None
    ) -> tuple[bool, list[Any]]:
        """Every rank, one collective: wait for the write in flight and agree on it, gathering each rank's
        `payload` on the way (a save's random streams: one collective where two would be); returns (whether a
        checkpoint was completed, the payloads in rank order). A failed write raises CheckpointError on every
        rank; one whose writer is gone, or that was abandoned (live mode), counts if it reached the disk
        whole, else a warning says it was dropped (the checkpoints before it stay)."""
        step, writing = self._pending, self._writing
        if step is None and payload is None:
            return False, []  # nothing to settle or gather (every rank knows whether a write is pending)
        self._pending = self._writing = None
        abandoned, self._abandoned = self._abandoned, False
        if writing is not None and get_rank() != 0:
            writing.join()  # this rank's shards: its failure is in the writer rank's outcome
        outcome: tuple[str, str, str] | None = None  # (failed or lost, why, how it was lost)
        failure: BaseException | None = None
        if step is not None and get_rank() == 0:
            if writing is not None:
                failure = writing.join()
                outcome = None if failure is None else ("failed", describe_error(failure), "")
            else:  # live mode: its writer is gone, or it was abandoned; what reached the disk decides
                problem = validate(step_dir(step), step)
                how = (
                    "over a group that changed (the write was abandoned)"
                    if abandoned
                    else "by a rank that is gone"
                )
                outcome = None if problem is None else ("lost", problem, how)
        gathered = all_gather_object((payload, outcome))
        payloads, outcome = [p for p, _ in gathered], gathered[0][1]
        if step is None:
            return False, payloads
        if outcome is None:
            return True, payloads
        if outcome[0] == "lost":  # not an error of the run's: the next save writes a newer one
            self._log.warning(
                "checkpoint %s was being written %s and is incomplete (%s); the checkpoints before it are kept",
                step_dirname(step),
                outcome[2],
                outcome[1],
            )
            return False, payloads
        raise CheckpointError(
            f"{tag}checkpoint {step_dirname(step)} was not saved (written in the background): {outcome[1]}"
        ) from failure


class ShardedWrites:
    """A manager's background sharded writes: their own gloo group (made once per group of ranks, by every
    rank, so that their collectives never interleave with training's), and in live mode the writes abandoned
    when the group changed, by their temp directories, which must never publish."""

    def __init__(self, saves: BackgroundSaves) -> None:
        self.saves = saves
        self.group: dist.ProcessGroup | None = None
        self.in_flight: Path | None = None  # the temp directory of the last write started
        self._abandoned: set[Path] = set()
        self._publishing = threading.Lock()  # held by a writer thread while it publishes

    def gloo_group(self) -> dist.ProcessGroup:
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        return self.group

    def regroup(self) -> None:
        """The group changed: the write in flight is abandoned (BackgroundSaves.abandon) and can never
        publish (a write publishing now finishes first), and the next one makes its group anew."""
        if self.group is None:
            return
        self.group = None
        with self._publishing:
            if self.saves.abandon() is not None and self.in_flight is not None:
                self._abandoned.add(self.in_flight)

    @contextmanager
    def publishing(self, temp: Path | None) -> Iterator[bool]:
        """Held while a write publishes the checkpoint in `temp`: whether it may (not abandoned)."""
        with self._publishing:
            yield temp not in self._abandoned


class _Failed:
    """A background write that never started (the writer's copy failed): settled like a failed write."""

    def __init__(self, failure: BaseException) -> None:
        self._failure = failure

    def join(self) -> BaseException:
        return self._failure


def describe_error(exc: BaseException) -> str:
    """An exception as every rank is told it: a CheckpointError's own message, else its type and message."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
