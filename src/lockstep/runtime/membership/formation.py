"""Forming a generation: check in, agree on its members, form its process group; leave a broken one.

1. Each member of generation g checks in to g+1 (`gen<g+1>/in/<member>`) and waits until every member
   of g has checked in or is known dead (`dead/<member>`). A member silent past the check-in timeout is
   left out; so is one whose process this host sees stopped (`proc/<member>`: its host and pid) at every
   look for STOPPED_GRACE (stopped.py: the hang watchdog's rule, as none runs while the group re-forms),
   and one seen stopped or gone once the hang timeout has passed. A member left out is marked dead, so that
   the launcher ends it and starts its replacement.
2. The first to write `gen<g+1>/members` (compare_set: first writer wins) decides the members, in
   member-id order, replacements appended. A worker left out exits at once (EVICTED_EXIT_CODE); below
   --min-world every member raises WorldTooSmallError.
3. Each forms g+1's default process group under its own store prefix (reusing a prefix reads the old
   addresses), bounded by form_timeout(): a member that dies meanwhile leaves the others waiting for its
   address, so they give up (MembershipChanged) and form the next generation without it. A member whose
   group formed says so (`gen<g+1>/formed/<member>`) and goes on only once every member has: one that
   formed late, against groups the others abandoned, re-forms with them instead.

Leaving a broken group never waits for it: gloo cannot abort a collective and its destructor waits for
the abandoned work, so the group object is kept referenced (`abandoned`) and the process ends with os._exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lockstep.errors import MembershipChanged, WorldTooSmallError, rank_tag
from lockstep.runtime.membership import keys
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.host import Host
from lockstep.runtime.membership.records import Fault, Membership, first_line
from lockstep.runtime.membership.replica_groups import GROUP_LOST, broken_groups, whole_groups
from lockstep.runtime.membership.stopped import STOPPED_GRACE, StopClock, is_stopped
from lockstep.torch_private import reset_group_names, set_group_timeout

EVICTED_EXIT_CODE = 75  # a worker the survivors left out (it was too late to check in): EX_TEMPFAIL
FORM_TIMEOUT_S = 30.0  # longest wait for a new group to form (below the 60 s check-in timeout)
CHECKIN_TIMEOUT_S = 60.0


def form_timeout(hang: float) -> timedelta:
    """How long a new generation may take to form: 30 s, or the hang timeout (`hang`, 0: off) when that
    is shorter."""
    return timedelta(seconds=min(FORM_TIMEOUT_S, hang) if hang > 0 else FORM_TIMEOUT_S)


class Formation:
    """Agreeing on and forming this worker's next generation."""

    def __init__(
        self, state: GroupState, host: Host, backend: str, timeout: timedelta, min_world: int
    ) -> None:
        self.state, self.host = state, host
        self.backend, self.timeout, self.min_world = backend, timeout, min_world
        self.checkin_timeout = CHECKIN_TIMEOUT_S
        self.graveyard: list[Any] = []  # abandoned groups (see leave_group); the process ends with os._exit

    def next_generation(
        self,
        first: Membership,
        cause: BaseException | str,
        joiners: list[int] | tuple[int, ...],
        checkin_s: float | None = None,
    ) -> Fault:
        """Check in to the generation after the current one and agree on its members; the Fault counts
        who left and joined since `first` (the members before the change). `checkin_s`: at start-up,
        how long to wait for the others (else checkin_timeout); nobody waits in a collective yet then."""
        state = self.state
        old = state.membership
        g = old.generation + 1
        if not joiners and checkin_s is None:
            self._leave_if_evicted(old)
            # A growth bumps nothing: a peer finishing its last collective must not abandon it. Else,
            # before checking in: whoever waits on this rank stops waiting.
            state.count_change()
        members = self._check_in(old, g, joiners, checkin_s or self.checkin_timeout)
        lost = [m for m in first.members if m not in members]
        joined = [m for m in members if m not in first.members]
        for member in joined:
            state.store.set(keys.admit(member), str(g))  # every member writes it: the same value
        state.membership = Membership(g, members, old.member_id)
        how = state.dead()
        fault = Fault(
            generation=g,
            lost=lost,
            how={str(m): how.get(m, "did not check in") for m in lost},
            world_size=len(members),
            cause=first_line(cause),
            kind="lost" if lost else "joined",
            joined=joined,
        )
        if len(members) < self.min_world:
            raise WorldTooSmallError(
                f"{rank_tag(state.membership.rank, len(members))}launch ranks {lost} left the job "
                f"({_describe(fault.how)}); {len(members)} remain, fewer than --min-world {self.min_world}: "
                "the job ends. Its last checkpoint is intact; resume from it, or lower --min-world"
            )
        return fault

    def form_group(self) -> None:
        """init_process_group for the current generation, bounded: a member that dies while the group
        forms leaves the others waiting for its address, so they give up after form_timeout() and
        re-form without it."""
        m = self.state.membership
        prefix = dist.PrefixStore(keys.generation_prefix(m.generation), self.state.store)
        bounded = min(self.timeout, form_timeout(self.host.hang_timeout()))
        reset_group_names()  # a failed formation left torch's count of group names one up (torch_private.py)
        try:
            dist.init_process_group(
                self.backend, store=prefix, rank=m.rank, world_size=m.world_size, timeout=bounded
            )
        except (RuntimeError, dist.DistError) as exc:
            raise MembershipChanged(
                f"{rank_tag(m.rank, m.world_size)}forming generation {m.generation} of the group failed "
                f"({first_line(exc)}): a member died while it formed"
            ) from exc
        if bounded < self.timeout:
            set_group_timeout(self.timeout)  # collectives keep the job's own timeout
        self._confirm_formed(bounded.total_seconds())

    def _confirm_formed(self, wait_s: float) -> None:
        """Every member formed this generation, or none goes on in it. A member that formed it late can
        find its peers' addresses on the store and connect to the groups they abandoned when they gave up
        on it (those are kept referenced, see leave_group): it would then wait in its first collective
        forever while they formed the next generation. So each member says it formed (`gen<g>/formed/<me>`)
        and waits for all; a change seen first (the others give up and count one) makes it leave and
        re-form with them."""
        state = self.state
        m = state.membership
        state.store.set(keys.formed(m.generation, m.member_id), "1")
        formed = [keys.formed(m.generation, member) for member in m.members]
        deadline = time.monotonic() + wait_s
        while not state.store.check(formed):
            if (state.changed() or time.monotonic() > deadline) and not state.store.check(formed):
                self.leave_group()
                raise MembershipChanged(
                    f"{rank_tag(m.rank, m.world_size)}generation {m.generation} formed here, but not on every "
                    "member (one gave up on it, or died): it is formed again"
                )
            time.sleep(0.002)

    def leave_group(self) -> None:
        """Leave the broken group without waiting for it: work abandoned in it may never finish (gloo has
        no abort, and its destructor waits for pending work), so the group object is kept referenced."""
        if dist.is_initialized():
            self.graveyard.append(dist.group.WORLD)
            dist.destroy_process_group()

    def _leave_if_evicted(self, old: Membership) -> None:
        """A member the survivors evicted while it still runs (a straggler: the launcher kills it within
        its poll) must not count a change of its own, which the others would take for a new fault after
        they agreed without it: it leaves at once."""
        key = keys.dead(old.member_id)
        if self.state.store.check([key]):
            why = bytes(self.state.store.get(key)).decode()
            sys.stderr.write(f"lockstep: rank {old.member_id} (launch rank) was {why}; it exits\n")
            sys.stderr.flush()
            os._exit(EVICTED_EXIT_CODE)

    def _check_in(
        self, old: Membership, g: int, joiners: list[int] | tuple[int, ...], wait_s: float
    ) -> tuple[int, ...]:
        """Check in to generation g, agree on its members; leave the job if left out of them."""
        state = self.state
        state.store.set(keys.checkin(g, old.member_id), "1")
        members = self._agree(old, g, joiners, wait_s)
        # Every change behind this generation is counted by now (the launcher counts a death before it
        # marks the rank dead, a survivor before it checks in): a later change is a new fault.
        state.see_changes()
        if old.member_id not in members:
            sys.stderr.write(
                f"lockstep: rank {old.member_id} (launch rank) was left out of the group by the survivors "
                f"(generation {g}: {list(members)}); it exits\n"
            )
            sys.stderr.flush()
            os._exit(EVICTED_EXIT_CODE)
        return members

    def _agree(
        self, old: Membership, g: int, joiners: list[int] | tuple[int, ...], wait_s: float
    ) -> tuple[int, ...]:
        state = self.state
        started = time.monotonic()
        checked: set[int] = {old.member_id}
        left_out: dict[int, str] = {}
        looks = _Looks(self.state.store, self.host)
        while True:
            dead = state.dead()
            for member in old.members:
                if member not in checked and state.store.check([keys.checkin(g, member)]):
                    checked.add(member)
            # a member whose replica group lost one leaves with it: no one waits for it
            broken = broken_groups(old.members, state.group_size, dead)
            waiting = [m for m in old.members if m not in checked and m not in dead and m not in broken]
            waited = time.monotonic() - started
            left_out = looks.left_out(waiting, after_hang_timeout=waited >= self._look_after(wait_s))
            waiting = [m for m in waiting if m not in left_out]
            if not waiting or waited > wait_s:
                break
            time.sleep(0.005)
        for member in waiting:
            left_out[member] = f"did not check in to generation {g} within {wait_s:.0f} s"
        self._mark_left_out(left_out, g)
        gone = {*dead, *left_out}
        broken = broken_groups(old.members, state.group_size, gone)
        self._mark_left_out({m: f"{GROUP_LOST} {lost}" for m, lost in broken.items()}, g)
        state.known.update(joiners)
        # In the old generation's order (a replica group's place is its members' shard indices). In groups,
        # a member known gone is left out even if it checked in (it would break its group's place); one at
        # a time, it is proposed, and the group's formation fails without it. Joiners: whole groups only
        # (one that died since the growth was planned leaves its group's others queued).
        size = state.group_size
        staying = [
            m for m in old.members if m in checked and m not in broken and (size == 1 or m not in gone)
        ]
        joining = whole_groups([m for m in joiners if m not in state.dead()], size)
        proposal = json.dumps(staying + joining)
        agreed = state.store.compare_set(keys.members(g), "", proposal)
        return tuple(json.loads(bytes(agreed).decode()))

    def _look_after(self, wait_s: float) -> float:
        """When a member that has not checked in and is seen stopped (for less than the grace) or dead
        is left out: after the hang timeout, as the hang watchdog would have evicted it, which is stopped
        while the group re-forms (a member stopped or dead now would otherwise hold every other for the
        whole wait_s; a dead one's launcher usually marks it dead well before)."""
        hang = self.host.hang_timeout()
        return min(hang, wait_s) if hang > 0 else wait_s

    def _mark_left_out(self, left_out: dict[int, str], g: int) -> None:
        """Mark the members left out of generation g dead (the first to mark one names why): the launcher
        then ends them and starts their replacements, and none is queued again as a replacement."""
        for member, why in left_out.items():
            self.state.store.compare_set(keys.dead(member), "", f"left out of generation {g}: {why}")


class _Looks:
    """Formation's looks at the processes of members that have not checked in (where this host sees them)."""

    def __init__(self, store: Any, host: Host) -> None:
        self.store, self.host = store, host
        self.where: dict[int, dict[str, Any]] = {}  # member -> its `proc/<member>` (written once, at start)
        self.clock = StopClock()  # keyed by member, marked by its pid and its count of context switches
        self.stopped_grace = STOPPED_GRACE if host.hang_timeout() > 0 else float("inf")  # 0: no hang rule

    def left_out(self, waiting: list[int], *, after_hang_timeout: bool) -> dict[int, str]:
        """The members of `waiting` to leave out now, with why: seen stopped at every look for the grace;
        or, `after_hang_timeout`, seen stopped or gone at all."""
        out = {}
        now = time.monotonic()
        for member in waiting:
            where = self._whereabouts(member)
            why = self.host.gone(where) if where is not None else None
            stopped = is_stopped(why)
            mark = (where or {}).get("pid"), self.host.times_switched(where) if stopped and where else None
            stopped_for = self.clock.look(member, stopped, mark, now)
            if why is not None and (after_hang_timeout or stopped_for >= self.stopped_grace):
                out[member] = why
        return out

    def _whereabouts(self, member: int) -> dict[str, Any] | None:
        if member not in self.where:
            key = keys.whereabouts(member)
            if not self.store.check([key]):
                return None
            self.where[member] = json.loads(bytes(self.store.get(key)).decode())
        return self.where[member]


def _describe(how: dict[str, str]) -> str:
    return "; ".join(f"rank {m} {what}" for m, what in how.items())
