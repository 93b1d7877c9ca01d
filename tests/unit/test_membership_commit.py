"""runtime/membership/commit.py: a step counts on every member or on none, whatever each member saw.

Two members of one generation commit the same step on a real c10d TCPStore (each with its own client, as
two processes would); the change counter moves between their commits, as when a queued replacement dies
or a straggler is evicted. What each member sees differs (the first sees the counter move before the
second's key lands; the second sees every key), and both must follow one verdict.
"""

from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lockstep.errors import MembershipChanged
from lockstep.runtime.membership import keys
from lockstep.runtime.membership.commit import StepCommit
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.phases import GenerationPhase
from lockstep.runtime.membership.records import Membership


class QuietHost:
    """The process around the group, as commit() uses it: a tracked wait (no watchdog here)."""

    def tracked(self, op: str) -> Any:
        return nullcontext()


def _members(store: Any, generation: int = 3) -> list[StepCommit]:
    out = []
    for member in (0, 1):
        client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10))
        state = GroupState(client, Membership(generation, (0, 1), member), GenerationPhase.TRAINING)
        state.see_changes()
        out.append(StepCommit(state, QuietHost()))  # type: ignore[arg-type]
    return out


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def test_every_member_done_and_no_change_commits_on_both(store: Any) -> None:
    first, second = _members(store)
    store.set(keys.done(3, 7, 1), "1")  # the second member's key is already there (it is ahead)
    first.commit(7)
    second.commit(7)
    assert bytes(store.get(keys.verdict(3, 7))) == b"commit"
    assert first.state.phase.phase is GenerationPhase.TRAINING


def test_a_change_seen_before_the_last_key_lands_redoes_the_step_on_every_member(store: Any) -> None:
    """The split that the chaos schedules found: member 0 sees the counter move while member 1's key is
    missing and redoes the step; member 1 then writes its key, sees every key and, without the verdict,
    would count the step: the members would stand one step apart."""
    first, second = _members(store)
    store.add(keys.CHANGES, 1)  # e.g. a queued replacement died: not a member, but the counter moved
    with pytest.raises(MembershipChanged, match="step 7 .*redone"):
        first.commit(7)
    with pytest.raises(MembershipChanged, match="step 7 .*redone"):
        second.commit(7)  # it saw every key, and follows the verdict all the same
    assert bytes(store.get(keys.verdict(3, 7))) == b"redo"


def test_a_change_after_every_key_landed_still_commits_on_every_member(store: Any) -> None:
    first, second = _members(store)
    store.set(keys.done(3, 7, 1), "1")
    store.add(keys.CHANGES, 1)  # a member dies after its key: the step counted
    first.commit(7)
    second.commit(7)
    assert bytes(store.get(keys.verdict(3, 7))) == b"commit"


def test_verdicts_are_per_generation_and_step(store: Any) -> None:
    first, second = _members(store)
    store.add(keys.CHANGES, 1)
    with pytest.raises(MembershipChanged):
        first.commit(7)
    for member in (first, second):  # the group re-formed: generation 4, where step 7 is redone
        member.state.membership = Membership(4, (0, 1), member.state.membership.member_id)
        member.state.phase.enter(GenerationPhase.LOST)
        member.state.phase.enter(GenerationPhase.REFORMING)
        member.state.phase.enter(GenerationPhase.TRAINING)
        member.state.see_changes()
    store.set(keys.done(4, 7, 1), "1")
    first.commit(7)
    second.commit(7)
    assert bytes(store.get(keys.verdict(4, 7))) == b"commit"
