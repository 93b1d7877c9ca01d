"""runtime/membership/formation.py: agreeing on a generation's members when one of them never checks in.

Members agree on a real c10d TCPStore (each with its own client, as separate processes would). The member
that never checks in is a real process on this host: stopped (SIGSTOP) it is left out once seen stopped at
every look for STOPPED_GRACE (the hang watchdog's rule, which does not run while the group re-forms), not
after the hang timeout or the whole check-in timeout; stopped and started again, as a py-spy dump does, or
running but silent, it is left out after the check-in timeout. Either way it is marked dead, so that the
launcher ends it and the members never queue it again as a replacement (seed 19 of
benchmarks/results/2026-11-28-chaos.md: a member left out but not marked was planned as a joiner at every
step boundary, each growth waiting 65 s for it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lockstep.runtime.live_host import ProcessHost
from lockstep.runtime.membership import keys
from lockstep.runtime.membership.admission import Admission
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.formation import Formation, _Looks
from lockstep.runtime.membership.phases import GenerationPhase
from lockstep.runtime.membership.records import Membership
from lockstep.runtime.membership.replica_groups import (
    GROUP_LOST,
    broken_groups,
    lost_with_group,
    whole_groups,
)
from lockstep.runtime.membership.stopped import STOPPED_GRACE
from tests.helpers import wait_for_state


class Host(ProcessHost):
    """This process as a live group sees it, with a hang timeout of its own (no watchdog runs here)."""

    def __init__(self, hang: float) -> None:
        super().__init__(None)
        self.hang = hang

    def hang_timeout(self) -> float:
        return self.hang


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)


@pytest.fixture
def silent() -> Iterator[subprocess.Popen[bytes]]:
    """The member that never checks in: a process of its own on this host."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _member(store: Any, member: int, hang: float, checkin_s: float = 60.0) -> Formation:
    client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10))
    state = GroupState(client, Membership(0, (0, 1), member), GenerationPhase.TRAINING)
    formation = Formation(state, Host(hang), "gloo", timedelta(seconds=10), min_world=1)
    formation.checkin_timeout = checkin_s
    return formation


def _agree_without(store: Any, silent: subprocess.Popen[bytes], hang: float, checkin_s: float) -> Any:
    """Member 0 re-forms after a fault; member 1 (the `silent` process) never checks in."""
    store.set(keys.whereabouts(1), json.dumps(Host(hang).whereabouts() | {"pid": silent.pid}))
    member = _member(store, 0, hang, checkin_s)
    started = time.monotonic()
    fault = member.next_generation(member.state.membership, "a peer died", ())
    return fault, time.monotonic() - started, member


def test_a_member_stopped_while_the_group_re_forms_is_left_out_after_the_grace_not_the_hang_timeout(
    store: Any, silent: subprocess.Popen[bytes]
) -> None:
    silent.send_signal(signal.SIGSTOP)
    fault, waited, member = _agree_without(store, silent, hang=30.0, checkin_s=60.0)
    assert STOPPED_GRACE <= waited < 30.0  # seen stopped for the grace, not left at the 30 s hang timeout
    assert fault.lost == [1] and member.state.membership.members == (0,)
    why = bytes(store.get(keys.dead(1))).decode()
    assert why.startswith(f"left out of generation 1: stopped: its process (pid {silent.pid}) is stopped"), (
        why
    )
    assert fault.how == {"1": why}


def test_a_member_stopped_again_and_again_but_never_for_the_grace_is_waited_for(
    store: Any, silent: subprocess.Popen[bytes]
) -> None:
    """Stopped for 0.7 of every 0.75 s (py-spy dumps, back to back): never stopped for the whole grace, even
    where a loaded machine leaves no look inside a 0.05 s run (its count of context switches moved), so it
    is left out only at the check-in timeout (as stopped, or as silent: whatever the last look saw)."""
    done = threading.Event()

    def stop_and_start() -> None:
        while not done.is_set():
            silent.send_signal(signal.SIGSTOP)
            done.wait(0.7)
            silent.send_signal(signal.SIGCONT)
            done.wait(0.05)

    toggler = threading.Thread(target=stop_and_start)
    toggler.start()
    try:
        fault, waited, _ = _agree_without(store, silent, hang=30.0, checkin_s=3.0)
    finally:
        done.set()
        toggler.join(timeout=5)
    assert waited >= 3.0, (waited, fault.how)
    assert fault.lost == [1], fault


def test_a_member_started_and_stopped_again_between_two_looks_has_its_grace_start_anew(
    store: Any, silent: subprocess.Popen[bytes]
) -> None:
    """Formation's looks mark a stopped member by its pid and its count of context switches: a start and a
    stop that no look saw (a loaded machine) still move the count."""
    store.set(keys.whereabouts(1), json.dumps(Host(30.0).whereabouts() | {"pid": silent.pid}))
    looks = _Looks(store, Host(30.0))
    silent.send_signal(signal.SIGSTOP)
    wait_for_state(silent.pid, "Tt")
    assert looks.left_out([1], after_hang_timeout=False) == {}  # first seen stopped: the grace starts
    silent.send_signal(signal.SIGCONT)
    wait_for_state(silent.pid, "RS")
    silent.send_signal(signal.SIGSTOP)
    wait_for_state(silent.pid, "Tt")
    time.sleep(STOPPED_GRACE)
    assert looks.left_out([1], after_hang_timeout=False) == {}  # it ran in between: the grace starts anew
    time.sleep(STOPPED_GRACE)
    assert list(looks.left_out([1], after_hang_timeout=False)) == [1]


def test_with_the_hang_watchdog_off_a_stopped_member_is_waited_for_the_whole_check_in_timeout(
    store: Any, silent: subprocess.Popen[bytes]
) -> None:
    """--hang-timeout 0 turns the stop rule off with the watchdog: only the check-in timeout leaves it out
    (its reason still says stopped: the last look saw it)."""
    silent.send_signal(signal.SIGSTOP)
    fault, waited, _ = _agree_without(store, silent, hang=0.0, checkin_s=2.0)
    assert waited >= 2.0, waited
    assert fault.how["1"].startswith("left out of generation 1: stopped: its process"), fault.how


def test_a_member_running_but_silent_is_left_out_after_the_check_in_timeout_and_marked_dead(
    store: Any, silent: subprocess.Popen[bytes]
) -> None:
    fault, waited, _ = _agree_without(store, silent, hang=0.5, checkin_s=2.0)
    assert waited >= 2.0  # its process runs: it is waited for the whole check-in timeout
    assert fault.lost == [1]
    assert (
        bytes(store.get(keys.dead(1))).decode()
        == "left out of generation 1: did not check in to generation 1 within 2 s"
    )


def test_a_member_left_out_is_never_queued_again_as_a_replacement(
    store: Any, silent: subprocess.Popen[bytes]
) -> None:
    """Member 1 had joined as a replacement (it is in the join queue); once left out it is no joiner."""
    store.add(keys.JOIN_COUNT, 1)
    store.set(keys.join_entry(1), "1")
    silent.send_signal(signal.SIGSTOP)
    _, _, member = _agree_without(store, silent, hang=0.5, checkin_s=60.0)
    assert Admission(member.state).joiners_due(step=10) == []
    assert not store.check([keys.growth(1)])  # rank 0 planned no growth


def test_a_member_that_checks_in_is_not_left_out(store: Any, silent: subprocess.Popen[bytes]) -> None:
    """The look at a process is only for members that have not checked in: one stopped after it checked in
    is a member (the group's formation then gives up on it)."""
    silent.send_signal(signal.SIGSTOP)
    store.set(keys.checkin(1, 1), "1")
    fault, _, member = _agree_without(store, silent, hang=0.5, checkin_s=60.0)
    assert fault.lost == [] and member.state.membership.members == (0, 1)
    assert not store.check([keys.dead(1)])


def _agree_in_groups(
    store: Any, old: Membership, agreeing: tuple[int, ...]
) -> tuple[list[Formation], list[Any]]:
    """The members `agreeing` of generation `old` (replica groups of 2) agree on the next one, each on a
    thread of its own with a store client of its own; their formations and faults."""
    members = []
    for member in agreeing:
        client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=10))
        state = GroupState(client, Membership(old.generation, old.members, member), GenerationPhase.TRAINING)
        state.group_size = 2
        state.known.update(old.members)
        members.append(Formation(state, Host(60.0), "gloo", timedelta(seconds=10), min_world=2))
    faults: list[Any] = [None] * len(members)

    def agree(i: int) -> None:
        faults[i] = members[i].next_generation(members[i].state.membership, "a peer died", ())

    threads = [threading.Thread(target=agree, args=(i,)) for i in range(len(members))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return members, faults


def test_in_replica_groups_a_member_whose_group_lost_one_is_left_out_at_once_and_marked_dead(
    store: Any, silent: subprocess.Popen[bytes]
) -> None:
    """4 members in 2 replica groups (a sharded run): member 3 is dead, member 2 (its group's other rank,
    `silent`: running, but stuck where it cannot check in) is not waited for; 0 and 1 form the generation,
    and member 2 is marked dead with its group, so that the launcher ends and replaces it with the group."""
    store.set(keys.whereabouts(2), json.dumps(Host(60.0).whereabouts() | {"pid": silent.pid}))
    store.set(keys.dead(3), "killed by SIGKILL")
    started = time.monotonic()
    members, faults = _agree_in_groups(store, Membership(0, (0, 1, 2, 3), 0), (0, 1))
    assert time.monotonic() - started < 10  # not the 60 s check-in timeout, nor the hang timeout
    for fault in faults:
        assert fault.lost == [2, 3] and fault.world_size == 2
    assert members[0].state.membership.members == (0, 1)
    assert bytes(store.get(keys.dead(2))).decode() == (
        "left out of generation 1: its replica group lost rank 3"
    )
    assert lost_with_group(bytes(store.get(keys.dead(2))).decode()) == 3


def test_replica_groups_leave_and_join_whole() -> None:
    assert broken_groups((0, 1, 2, 3, 4, 5), 2, {3}) == {2: 3}
    assert broken_groups((4, 5, 0, 1), 2, {4, 0}) == {5: 4, 1: 0}  # a replacement group first
    assert broken_groups((0, 1, 2, 3), 1, {1}) == {}  # one rank a group: nothing else leaves
    assert whole_groups([7, 8, 9], 2) == [7, 8] and whole_groups([7], 2) == [] and whole_groups([7], 1) == [7]
    assert lost_with_group("killed by SIGKILL") is None
    assert lost_with_group(f"left out of generation 4: {GROUP_LOST} 12") == 12


def test_in_replica_groups_the_members_keep_their_order_not_their_ids_order(store: Any) -> None:
    """A replacement group that queued as 5 then 4 sits as (…, 5, 4): member 5 holds shard 0 of its group.
    When the other group is lost, the generation must keep (5, 4), not sort it to (4, 5), which would hand
    each of them the other's shard index (the review's scenario: a model silently permuted)."""
    store.set(keys.dead(0), "killed by SIGKILL")
    members, _ = _agree_in_groups(store, Membership(3, (0, 1, 5, 4), 0), (5, 4))
    assert [f.state.membership.members for f in members] == [(5, 4), (5, 4)]
    assert [f.state.membership.rank for f in members] == [0, 1]
