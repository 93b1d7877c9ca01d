"""runtime/waits.py in live mode: a wait polls the membership it watches, also on a collective whose Work
says it is complete only inside wait() (gloo's reduce-scatter, which FSDP2 and the sharded exact sums issue:
polling its is_completed() waited forever, and every sharded run in live mode hung in its first backward).

Real gloo on 2 ranks; the watched membership is an object of lockstep's Watched protocol that says a member
was lost after a set time (what runtime/membership/group.py's check() raises).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lockstep.errors import MembershipChanged
from lockstep.runtime import waits
from lockstep.testing import run_distributed

pytestmark = pytest.mark.fresh_ranks  # the ranks watch a membership of the test's own

TIMEOUT = 60


class _LostAfter:
    """A membership whose check() raises once `seconds` have passed."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() >= self.at:
            raise MembershipChanged("a member was lost (the test's)")


def _reduce_scatter() -> Any:
    out = torch.empty(2, dtype=torch.float64)
    work = dist.reduce_scatter_single(output=out, input=torch.ones(4, dtype=torch.float64), async_op=True)
    return work, out


def _completes_under_a_watched_membership() -> list[float]:
    waits.watch_membership(_LostAfter(3600.0))
    try:
        work, out = _reduce_scatter()
        assert not work.is_completed()  # and never will be before wait(): what the waits must not poll
        waits.wait_watching_membership(work)
        return out.tolist()
    finally:
        waits.watch_membership(None)


def _a_lost_member_ends_the_wait() -> float:
    """Rank 1 joins the reduce-scatter only well after rank 0's wait gave up on the membership's word (the
    abandoned collective then completes, so that both ranks end cleanly)."""
    work, _ = (None, None) if dist.get_rank() == 1 else _reduce_scatter()
    if dist.get_rank() == 1:
        time.sleep(2.0)
        _reduce_scatter()[0].wait()
        return 0.0
    waits.watch_membership(_LostAfter(0.5))
    started = time.monotonic()
    try:
        with pytest.raises(MembershipChanged):
            waits.wait_watching_membership(work)
        return time.monotonic() - started
    finally:
        waits.watch_membership(None)
        work.wait()


def test_a_reduce_scatter_that_completes_only_in_wait_is_waited_on_under_live_mode() -> None:
    assert run_distributed(_completes_under_a_watched_membership, 2, timeout=TIMEOUT) == [[2.0, 2.0]] * 2


def test_a_lost_member_ends_a_wait_on_such_a_collective_at_once() -> None:
    waited = run_distributed(_a_lost_member_ends_the_wait, 2, timeout=TIMEOUT)[0]
    assert 0.5 <= waited < 1.5  # at the membership's word, not when the collective completed (2 s)
