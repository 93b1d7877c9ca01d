"""Live mode inside fit: work between steps that counts on every member or on none, as a step does.

A collective can complete on some ranks and fail on others (a lost member sent its last bytes to some peers
only). After a step that is settled by the step's commit (runtime/membership/commit.py); the work between
steps that issues collectives (a log, an evaluation, a checkpoint: `AGREED`) needs the same, or a member
whose copy of a checkpoint's last collective completed goes on to the next step while another, whose copy
failed, redoes the checkpoint: their collectives mismatch (gloo aborts on a size mismatch, and one of equal
sizes would mix two operations silently). So such work ends with a commit of its own (one store round trip):
either every member completed it, or every member redoes it (the members' marks reconcile what some of
them had finished, as a save: runtime/membership/recovery.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")
AGREED = frozenset({"_after_step", "_end_of_epoch", "_end_of_run"})  # FitRun's work between steps


class Committer(Protocol):
    """The live group's commit (runtime/membership/group.py)."""

    def commit(self, step: int, rows: bytes | None = None, *, work: str = "") -> None: ...


def agreed_between_steps(group: Committer, step: Callable[[], int], work: Callable[[], T]) -> Callable[[], T]:
    """`work` followed by its commit when it is one of `AGREED` (named by its function), else `work` itself;
    `step()`: the steps done, which the commit's keys name with the work."""
    name = getattr(work, "__name__", "")
    if name not in AGREED:
        return work

    def done_everywhere() -> T:
        result = work()
        group.commit(step(), work=name)
        return result

    return done_everywhere
