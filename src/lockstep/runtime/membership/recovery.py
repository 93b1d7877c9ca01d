"""Live recovery for a training loop: one implementation, used by `lockstep.fit` and by `LiveLoop`.

The loop hands its run over as a `Recoverable` (a small Protocol: the replica, the state, the shards)
and calls, from its own places:

- `recover(exc)` when a collective failed: re-form over the survivors, rebuild the replica on the new
  group, make every member stand at the same step, re-cut the shards. The loop then redoes the step it
  was in, or the work after a step it was doing. False when the error is not a lost member's (raised by
  the program's own code, `is_lost_member`) or nobody left: the error is the program's own.
- `admit_joiners(step)` after each completed step: a growth that rank 0 planned one step ago happens, the
  replacements receive the state from rank 0.
- `receive_state()`: a replacement's first act: the state of the run it joins, from rank 0.

The loop reaches `recover` through its step driver (trainer/run/step_driver.py), for its steps, the work
between them (evaluation, a checkpoint) and the admissions alike; before the run exists, the start-up's
collectives recover through `StartUpRecovery`.

After every change the members compare their progress marks (the step first: a step counts on every
member or on none, membership/commit.py, so a difference is an InternalError on every rank); marks that
may differ legitimately (a save or an evaluation that completed on some members only) are reconciled by
the run, which then redoes that work on every member.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Generic, Protocol, TypeVar, cast

import torch.distributed as dist

from lockstep.errors import InternalError, LockstepError, MembershipChanged, StateLostError
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.group import LiveGroup, PlaceT
from lockstep.runtime.membership.host import Place
from lockstep.runtime.membership.records import Fault

PlaceIn = TypeVar("PlaceIn", bound=Place, contravariant=True)  # what the run is handed: runtime's Topology
NO_STATE = -1  # the step a replacement reports before it received its state
FAILURES = (RuntimeError, dist.DistError)  # how a lost member surfaces in a collective


class Recoverable(Protocol[PlaceIn]):
    """What live recovery needs of a training loop's run (PlaceIn: the group's Topology)."""

    @property
    def faults(self) -> list[dict[str, Any]]:
        """The run's record of membership changes (summary.json's `faults`): recovery appends to it."""

    def release_replica(self) -> None:
        """Drop the replica: nothing may keep the old group alive (destroying it closes its sockets,
        which is how survivors still waiting in it learn of the death at once)."""

    def rebuild_replica(self, topology: PlaceIn) -> None:
        """Replicate the model over the group just formed (`topology`: this rank's place in it)."""

    def discard_step(self) -> None:
        """Forget the abandoned step's partial gradients."""

    def marks(self) -> dict[str, Any]:
        """Where this member stands: {"step": optimizer steps done, ...}; JSON values."""

    def reconcile(self, mark: str) -> None:
        """`mark` (not the step) differs between members: make every member redo the work behind it."""

    def state_dict(self) -> dict[str, Any]:
        """What a replacement needs to continue exactly where the members stand."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def reshard(self, topology: PlaceIn) -> None:
        """Cut this rank's shard of the data (and of the evaluation) for the group's new world."""

    def share_shards(self, holders: list[int]) -> None:
        """Every member, after rank 0's state went to the replacements: a sharded model's replacement
        group receives its shards from the ranks of `holders` that hold the same ones (a collective)."""

    def regrouped(self, fault: Fault) -> None:
        """The group changed and every member stands at the same step: take over what a lost member
        did (rank 0's duties), tell the user."""


class LiveRecovery(Generic[PlaceT]):
    """The loop's side of live mode for one run (see the module doc)."""

    def __init__(self, group: LiveGroup[PlaceT], run: Recoverable[PlaceT]) -> None:
        self.group, self.run = group, run
        self.changes = 0  # membership changes this run went through (lost or grown)

    def startup_faults(self) -> list[dict[str, Any]]:
        """Members lost at start-up, before the loop began: faults of this run too."""
        records = [fault.record(0) for fault in self.group.faults]
        for record in records:
            self.group.host.note_change(record)
        return records

    def recover(self, exc: BaseException) -> bool:
        """A collective failed: re-form over the survivors and re-cut the work. False when no member left
        (the error is the program's own): the caller re-raises it. A member lost while the group re-forms,
        rebuilds the replica or sends a replacement its state makes the survivors do it all again."""
        group = self.group
        if not lost_member_or_changed(group.state, exc):
            return False
        with group.host.recovering():
            before = group.membership.members
            self.run.release_replica()
            fault = group.reform(exc)
            if group.membership.members == before and not isinstance(exc, MembershipChanged):
                return False
            self.run.discard_step()
            try:
                self._rejoin(fault)
            except FAILURES as again:  # another fault inside this recovery: recover from that one too
                if not self.recover(again):
                    raise
        return True

    def admit_joiners(self, step: int, next_step: int | None = None) -> bool:
        """At a step boundary: let in the replacements that rank 0 planned for this step. True when the
        group changed (the loop re-cuts its iteration). `next_step`: the boundary after this one when growth
        happens only at some steps (the ends of a low-communication run's rounds; called only there). A
        member or a replacement lost in the growth raises, and the loop's step driver recovers from it
        like from any other loss (trainer/run/step_driver.py, `changed_by`)."""
        joiners = self.group.joiners_due(step, next_step)
        if not joiners:
            return False
        with self.group.host.recovering():
            self.run.release_replica()
            self._rejoin(self.group.reform(f"replacements {joiners} join after step {step}", joiners))
        return True

    def receive_state(self) -> None:
        """A replacement, at the start of its loop: the state of the run it joins, from a member that holds
        it (a collective that the members enter from admit_joiners). A member lost meanwhile: this process
        re-forms with the others, as a member of the generation it was admitted to, and receives the state
        over the next generation."""
        group = self.group
        if not group.needs_state:
            raise InternalError("receive_state is for a live-mode replacement that has no state yet")
        try:
            self._converge()
        except FAILURES as exc:
            if not self.recover(exc):
                raise
            return  # recover() re-cut the shards
        self.run.reshard(group.topology())

    def _rejoin(self, fault: Fault) -> None:
        """After a new generation formed: the replica on it, the replacements' state, the shards re-cut."""
        self.changes += 1
        topology = self.group.topology()
        # Recorded first: a member lost in what follows makes another change, and both are in the record.
        # Before _converge: a replacement receives the list with this record.
        record = fault.record(int(self.run.marks()["step"]))
        self.run.faults.append(record)
        self.group.host.note_change(record)
        self.run.rebuild_replica(topology)
        record["step"] = int(self.run.marks()["step"])  # a low-communication run went back to its mark
        started = time.monotonic()
        self._converge()
        record["detail"]["converge_s"] = round(time.monotonic() - started, 4)  # with the state sent, if any
        self.run.reshard(topology)
        self.run.regrouped(fault)

    def _converge(self) -> None:
        """Every member stands at the same step; a replacement receives the state from rank 0."""
        group, run = self.group, self.run
        gathered = group.host.all_gather_object({"step": NO_STATE} if group.needs_state else run.marks())
        members = [marks for marks in gathered if marks["step"] != NO_STATE]
        # A collective can complete on some ranks and fail on others: work that one member finished and
        # another did not (a save, an evaluation) is redone by all, so that they issue the same collectives.
        for mark in sorted({name for marks in members for name in marks} - {"step"}):
            if len({repr(marks.get(mark)) for marks in members}) > 1:
                run.reconcile(mark)
        steps = {int(marks["step"]) for marks in members}
        if len(steps) > 1:
            raise InternalError(
                f"{group.state.tag}after a change of members the ranks stand at different steps "
                f"({min(steps)} to {max(steps)}), although a step counts on every member or on none "
                "(membership/commit.py); resume from the last checkpoint"
            )
        if len(members) == len(gathered):
            return
        # The state comes from the lowest-ranked member that holds it: rank 0, unless the lowest member
        # ids left are replacements still waiting for theirs (every original member lost meanwhile).
        holders = [rank for rank, marks in enumerate(gathered) if marks["step"] != NO_STATE]
        if not holders:
            raise StateLostError(
                f"{group.state.tag}every member that held the run's state was lost: only replacements that "
                "had not received it remain. Resume from the last checkpoint"
            )
        src = holders[0]
        mine = run.state_dict() if group.membership.rank == src else None
        tree = group.host.broadcast_state(mine, src=src)
        run.share_shards(holders)
        if group.needs_state:
            run.load_state_dict(tree)
            group.state_received()


def is_lost_member(exc: BaseException) -> bool:
    """Whether a failure can be a lost member's doing, and so starts a recovery: lockstep's own signal that
    the members changed, or a transport error. gloo reports a dead peer as a plain RuntimeError, so the
    type cannot tell a transport error from the program's own RuntimeError (its forward, its loss, a check
    of its own): where it was raised does (`raised_by_transport`). The program's own exception ends the job
    at once on every rank (the launcher stops the others), with no re-formation; so do lockstep's other
    errors (InternalError, StateLostError, WorldTooSmallError, a usage error). The membership has the last
    word: a recovery after which the same members stand says the error was not a lost member's
    (`LiveRecovery.recover` returns False)."""
    if isinstance(exc, MembershipChanged):
        return True
    if isinstance(exc, LockstepError) or not isinstance(exc, FAILURES):
        return False
    return isinstance(exc, dist.DistError) or raised_by_transport(exc)


def lost_member_or_changed(state: GroupState, exc: BaseException) -> bool:
    """`is_lost_member(exc)`, or the membership's verdict: a failure that is no lockstep error, while the
    store counts a change of members since this generation formed (a transport error that surfaced outside
    torch.distributed's and lockstep's code, if there is such a path, still recovers)."""
    if is_lost_member(exc):
        return True
    return isinstance(exc, FAILURES) and not isinstance(exc, LockstepError) and state.changed()


# Where collectives are issued and waited on: torch.distributed, and lockstep itself (its engine's buckets,
# its own small collectives, the membership's store calls). Real paths: a frame's file name is compared.
_TRANSPORT_DIRS = tuple(
    os.path.realpath(os.path.dirname(cast(str, module.__file__))) + os.sep
    for module in (dist, sys.modules[__name__.split(".", 1)[0]])
)


def raised_by_transport(exc: BaseException) -> bool:
    """The innermost frame of `exc`'s traceback is torch.distributed's or lockstep's code: a collective, a
    wait or a store call failed there (an error in C++ surfaces in the Python frame that called it). The
    program's code, and torch's outside torch.distributed (a shape mismatch in a forward), are not."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(_TRANSPORT_DIRS)


class StartUpRecovery(Generic[PlaceT]):
    """Live recovery before the loop's run exists: a member lost in the start-up's collectives (replicating
    a model, loading a checkpoint) re-forms the group over the survivors, and the step driver does the
    work again (trainer/run/step_driver.py). There is no replica to release or state to converge yet."""

    def __init__(self, group: LiveGroup[PlaceT]) -> None:
        self.group = group
        self.changes = 0

    def recover(self, exc: BaseException) -> bool:
        """Re-form over the survivors; False when no member's loss explains `exc` (nobody left)."""
        group = self.group
        if not lost_member_or_changed(group.state, exc):
            return False
        before = group.membership.members
        group.reform(exc)
        if group.membership.members == before and not isinstance(exc, MembershipChanged):
            return False  # nobody left: the error is the program's own
        self.changes += 1
        return True
