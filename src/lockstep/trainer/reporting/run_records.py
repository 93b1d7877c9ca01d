"""What fit keeps of a run besides its metrics: its time account (goodput, runtime/run_account.py) and its
timeline (runtime/timeline/), opened with the run, carried through a resume, closed at its end.

Every rank keeps both: whichever ends as rank 0 reports the account, and each rank's part of the timeline
goes into the merged trace. A restart of the job (its attempt > 0) carries the account on from the
checkpoint it resumes from, loses the samples of the steps the crashed attempt had counted after it, and
marks the restart on the timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from lockstep.checkpoint import CheckpointManager
from lockstep.runtime.collectives import broadcast_object
from lockstep.runtime.env.topology import Topology
from lockstep.runtime.logging import get_logger
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.run_account import ACCOUNT, restart_attempt
from lockstep.runtime.timeline import TIMELINE, clear_old_parts, part_stamps, read_parts
from lockstep.trainer.reporting.run_log import RunLog


class Side(Protocol):
    """What the run's side (trainer/live/live_side.py) tells of this process."""

    @property
    def member_id(self) -> int: ...

    @property
    def restarts(self) -> int | None: ...

    @property
    def joining(self) -> bool: ...

    def topology(self) -> Topology: ...


class RunRecords:
    """One fit run's account and timeline (see the module doc)."""

    def __init__(self, run_dir: Path, side: Side, rank: int, checkpoints: CheckpointManager) -> None:
        """Rank 0 of a run with no checkpoint to resume from (not a replacement, not a restart) clears the
        timeline parts an earlier run left in `run_dir` now, before the start-up's collectives (the
        replica's model check), which no rank passes before rank 0 comes to them: a rank writes its first
        part at its first step, so none of this run's is lost (clearing later raced a fast rank's part)."""
        self.attempt = max(restart_attempt(), side.restarts or 0)  # whole-job restarts before this attempt
        ACCOUNT.reset()  # the account starts at the run's first step
        member = side.member_id
        key = f"attempt{self.attempt}-member{member}"
        self.run_dir = run_dir
        TIMELINE.open(run_dir, track=f"member {member} (rank {rank} at start)", key=key)
        self.clears = side.topology().rank == 0 and not (side.joining or self.attempt)
        self.old_parts: dict[str, int] = {}  # parts found at the open, kept until the checkpoints are tried
        if self.clears and not checkpoints.steps():
            clear_old_parts(run_dir, keep=key)
        elif self.clears:
            self.old_parts = part_stamps(run_dir)

    def load(self, checkpoints: CheckpointManager, entries: dict[str, Any]) -> int | None:
        """Load the newest checkpoint into `entries` (its step; None without one). A restart of this job
        carries the account on from it (the time since it was taken is lost to the restart); a new job that
        resumes leaves the time between jobs out; a checkpoint older than the account loads without it."""
        ACCOUNT.arriving = "restart" if self.attempt else "new job"
        return checkpoints.load(entries, optional=frozenset({"goodput"}))

    def resumed(self, step: int | None, runlog: RunLog, global_batch: int) -> None:
        """The run resumed at `step` (None: from scratch). A restart, or a resume from a checkpoint: rank 0's
        log says how far the attempt before had come and what it had lost by then (earlier restarts, which
        the checkpoint may predate): the steps in between are undone, their samples lost too (and trained
        again). A restart with no checkpoint carries on from the crashed attempts' first step. A fresh run
        has nothing to carry on (an earlier run's trace parts went when it opened; where it found checkpoints,
        none of which loaded, they go now: those found at the open and not written since)."""
        if step is None and not self.attempt:
            if self.clears:
                clear_old_parts(self.run_dir, keep=TIMELINE.key, unchanged_since=self.old_parts)
            return
        reached, lost_before = broadcast_object(runlog.last_step())
        if reached > (step or 0):
            ACCOUNT.lose_samples(max(0, lost_before - ACCOUNT.samples_lost))
            ACCOUNT.lose_samples((reached - (step or 0)) * global_batch)
        if step is None:
            begun = [p["first_step_wall"] for p in read_parts(self.run_dir) if p.get("first_step_wall")]
            if begun:
                ACCOUNT.restarted_from_scratch(min(begun))
        if self.attempt:
            TIMELINE.mark(f"restart {self.attempt} from step {step or 0}", kind="restart", step=step or 0)

    @staticmethod
    def step_counted() -> None:
        """A step counted: the account's last step ends here."""
        ACCOUNT.step_ended()

    @staticmethod
    def close() -> None:
        """The run is over on this rank: its part of the timeline is written one last time (a write that
        fails costs the trace, never the run: it is logged)."""
        _last_write(TIMELINE.close)
        PROGRESS.loop_done()

    @staticmethod
    def failed() -> None:
        """The run failed on this rank: its part of the timeline up to here (what the launcher merges), and
        nothing recorded any more; the failure itself propagates whatever the write does."""
        _last_write(TIMELINE.close)
        PROGRESS.loop_done()


def _last_write(close: Callable[[], None]) -> None:
    try:
        close()
    except OSError as exc:
        get_logger("lockstep.fit").warning("the run's timeline part could not be written: %s", exc)
