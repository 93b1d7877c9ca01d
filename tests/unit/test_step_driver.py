"""trainer/run/step_driver.py: a step's outcome (DONE / REDO / ROLLED_BACK), the except-recover sequence once."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import pytest
import torch.distributed as dist

from lockstep.errors import InternalError, MembershipChanged, UsageError, WorldTooSmallError
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.phases import GenerationPhase
from lockstep.runtime.membership.records import Membership
from lockstep.runtime.membership.recovery import LiveRecovery, is_lost_member, lost_member_or_changed
from lockstep.trainer.run.step_driver import Outcome, RolledBack, StepDriver


class FakeRecovery:
    """Stands in for LiveRecovery: recover() re-forms (counts a change) unless nobody left."""

    def __init__(self, *, survives: bool = True) -> None:
        self.survives, self.changes, self.seen = survives, 0, []

    def recover(self, exc: BaseException) -> bool:
        self.seen.append(str(exc))
        if self.survives:
            self.changes += 1
        return self.survives


class Mark:
    def __init__(self, active: bool) -> None:
        self.active = active
        self.marked_at = None  # when the mark was taken (runtime/run_account.py): unknown here


def _failing(times: int) -> Any:
    calls = {"n": 0}

    def work() -> int:
        calls["n"] += 1
        if calls["n"] <= times:
            raise RuntimeError(f"peer lost {calls['n']}")
        return calls["n"]

    return work


def _driver(recovery: FakeRecovery | None, rollback: Mark | None = None) -> StepDriver:
    return StepDriver(cast(LiveRecovery, recovery), rollback)


def test_outside_live_mode_a_step_is_done_or_its_failure_propagates() -> None:
    driver = _driver(None)
    assert driver.attempt(lambda: 7) == (Outcome.DONE, 7)
    with pytest.raises(RuntimeError, match="peer lost 1"):
        driver.attempt(_failing(1))
    assert driver.changes == 0


def test_a_lost_member_makes_the_step_redone_or_rolled_back() -> None:
    recovery = FakeRecovery()
    assert _driver(recovery).attempt(_failing(1)) == (Outcome.REDO, None)
    assert _driver(recovery, Mark(active=False)).attempt(_failing(1)) == (Outcome.REDO, None)
    assert _driver(recovery, Mark(active=True)).attempt(_failing(1)) == (Outcome.ROLLED_BACK, None)
    assert recovery.changes == 3


def test_run_redoes_work_until_done_and_raises_rolled_back_at_a_mark() -> None:
    recovery = FakeRecovery()
    driver = _driver(recovery)
    assert driver.run(_failing(2)) == 3  # two losses, done on the third attempt
    assert (driver.changes, recovery.seen) == (2, ["peer lost 1", "peer lost 2"])
    with pytest.raises(RolledBack):
        _driver(recovery, Mark(active=True)).run(_failing(1))


def test_a_failure_no_loss_explains_is_the_programs_own() -> None:
    with pytest.raises(RuntimeError, match="peer lost 1"):
        _driver(FakeRecovery(survives=False)).attempt(_failing(1))
    with pytest.raises(ValueError):
        _driver(FakeRecovery()).attempt(lambda: int("x"))  # not a collective's failure: never recovered


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (MembershipChanged("the group lost a member"), True),
        (dist.DistNetworkError("connection to the store lost"), True),  # a DistError: the transport's
        (RuntimeError("loss is NaN"), False),  # gloo's type, but raised by the program
        (InternalError("after a change of members the ranks stand at different steps"), False),
        (WorldTooSmallError("1 remain, fewer than --min-world 2"), False),
        (UsageError("no_sync() inside accumulate()"), False),
        (ValueError("the program's own"), False),
    ],
)
def test_only_a_transport_failure_or_a_membership_signal_can_be_a_lost_member(
    exc: BaseException, lost: bool
) -> None:
    """lockstep's own errors and the program's end the job: a recovery would hide them (and loop on them)."""
    try:
        raise exc  # from this test's code: the program's, for a RuntimeError
    except BaseException as raised:  # noqa: BLE001
        assert is_lost_member(raised) is lost


def test_a_failure_while_the_store_counts_a_change_of_members_recovers_wherever_it_was_raised() -> None:
    """The membership's verdict: a RuntimeError raised outside the transport's code still recovers when a
    change of members was counted since this generation formed; lockstep's own errors never do."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    state = GroupState(store, Membership(1, (0, 1), 0), GenerationPhase.TRAINING)
    state.see_changes()
    try:
        raise RuntimeError("raised where no collective is")
    except RuntimeError as exc:
        assert not lost_member_or_changed(state, exc)
        state.count_change()  # a peer died meanwhile
        assert lost_member_or_changed(state, exc)
    assert not lost_member_or_changed(state, InternalError("the ranks stand at different steps"))
