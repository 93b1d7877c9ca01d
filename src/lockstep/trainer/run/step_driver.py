"""One step driver for fit's loop and `LiveLoop`: a step's work, and what a lost member makes of it.

Every step, and every piece of work between steps that issues collectives (a log, an evaluation, a
checkpoint, the end of a round), runs through a `StepDriver`. Its outcome is one of `Outcome`:

- DONE: the work completed.
- REDO: a member was lost in it; the group re-formed over the survivors (runtime/membership/recovery.py)
  and every member stands where the work started: the caller cuts its data for the new group again and
  redoes the work.
- ROLLED_BACK: a member was lost, and the run went back to its last round mark (a low-communication run in
  live mode: trainer/live/live_rounds.py); the caller carries on from the mark (`RolledBack` takes the loop
  there).

The except-recover sequence is written here only: the start-up's collectives (replicating the model), the
steps, the work between steps and the admission of replacements all recover through a driver. The driver
knows nothing of the mode: it is given a `Recovery` (live mode's, runtime/membership/recovery.py, or
`NoRecovery`: a failure is the program's own and propagates) and a `Rollback` (a low-communication run's
round marks, or none), chosen once by the loop. A failure that no member's loss explains propagates too
(`recover()` says so).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol, TypeVar, cast

from lockstep.errors import LockstepError
from lockstep.runtime.membership.recovery import FAILURES
from lockstep.runtime.run_account import ACCOUNT, Point

T = TypeVar("T")


class Outcome(enum.Enum):
    """How one attempt at a step (or at work between steps) ended."""

    DONE = "done"  # completed
    REDO = "redo"  # a member was lost: re-cut for the survivors and do it again
    ROLLED_BACK = "rolled_back"  # a member was lost: the run stands at its last round mark


class RolledBack(LockstepError):  # noqa: N818 (not an error: control flow back to the loop's top)
    """The run went back to its last round mark over a new group: the loop continues from there."""


class Recovery(Protocol):
    """What the driver asks when work failed (runtime/membership/recovery.py's LiveRecovery and
    StartUpRecovery, or NoRecovery)."""

    @property
    def changes(self) -> int:
        """Membership changes so far (lost or grown)."""

    def recover(self, exc: BaseException) -> bool:
        """Re-form over the survivors; False when no member's loss explains `exc` (the caller re-raises)."""


class Rollback(Protocol):
    """Where a loss takes the run back to a mark instead of redoing the work (trainer/live/live_rounds.py)."""

    @property
    def active(self) -> bool:
        """A mark stands to go back to."""

    @property
    def marked_at(self) -> Point | None:
        """When the mark was taken: going back to it discards the work since (runtime/run_account.py)."""


class NoRecovery:
    """Outside live mode: the group never changes, and a failure is the program's own."""

    changes = 0

    def recover(self, exc: BaseException) -> bool:
        return False


class NoRollback:
    """No round marks (every run but a low-communication one in live mode): a loss redoes the work."""

    active = False
    marked_at = None


class StepDriver:
    """Runs a loop's work through recovery (see the module doc)."""

    def __init__(self, recovery: Recovery | None = None, rollback: Rollback | None = None) -> None:
        self.recovery: Recovery = recovery or NoRecovery()
        self.rollback: Rollback = rollback or NoRollback()

    @property
    def changes(self) -> int:
        """Membership changes so far (lost or grown): a loop re-cuts its iteration when this moved."""
        return self.recovery.changes

    def attempt(self, work: Callable[[], T]) -> tuple[Outcome, T | None]:
        """work() once: (DONE, its result), or, a member lost in it, (REDO or ROLLED_BACK, None). The
        work a loss throws away is redone work in the run's account (runtime/run_account.py)."""
        # the start of what a loss would discard: only where one can happen (NoRecovery: never)
        started = None if isinstance(self.recovery, NoRecovery) else ACCOUNT.point()
        try:
            return Outcome.DONE, work()
        except FAILURES as exc:
            back_to = self.rollback.marked_at if self.rollback.active else None
            if back_to or started:
                ACCOUNT.discard(back_to or started)  # type: ignore[arg-type]  # one of them is a Point
            if not self.recovery.recover(exc):
                raise
        return (Outcome.ROLLED_BACK if self.rollback.active else Outcome.REDO), None

    def changed_by(self, work: Callable[[], bool]) -> bool:
        """work() once, which tells whether it changed the group (replacements admitted): True when it did,
        or when a member was lost in it (the group re-formed meanwhile; the loop re-cuts its iteration)."""
        outcome, changed = self.attempt(work)
        return outcome is not Outcome.DONE or bool(changed)

    def run(self, work: Callable[[], T]) -> T:
        """work() to completion, done again over the survivors when a member is lost in it (REDO);
        RolledBack when the run went back to its mark instead."""
        while True:
            outcome, result = self.attempt(work)
            if outcome is Outcome.DONE:
                return cast(T, result)  # DONE carries work()'s result
            if outcome is Outcome.ROLLED_BACK:
                raise RolledBack
