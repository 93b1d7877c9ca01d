"""This worker's side of live mode: the group's generations, formed, re-formed and grown over one store.

Under `lockstep run -n N --min-world M` the launcher hosts the c10d store, starts the N workers and keeps
the others running when one dies; it writes `dead/<member>` (keys.py) within its poll interval. Each
worker forms generation 0 of the default group over all N members (formation.py). When a collective fails
on a survivor (its peer's sockets closed), the training loop's recovery (recovery.py) calls `reform()`:

1. it leaves the broken group without waiting for it. Every rank learns of the change within 10 ms even
   when its own collective does not fail (it waits on a survivor, not on the dead rank): while a
   collective is waited on, the waits poll `check()` (`Host.watch`), which reads the change counter
   that the launcher bumps when a rank dies and each survivor bumps as it checks in, and raises
   MembershipChanged;
2. it checks in to generation g+1, agrees on its members and forms its group (formation.py);
3. it restarts the hang watchdog over the new world; ranks are renumbered over the survivors in
   member-id order, while each worker keeps its member id.

A rank that stops answering (SIGSTOP, a hard hang) is evicted: when a survivor has waited on it past the
hang timeout and its heartbeat stopped, that survivor's watchdog calls `evict`, which marks it dead on the
store: a membership change like any other; the launcher then kills it. Steps are committed on every member
or none (commit.py); replacements are admitted at step boundaries (admission.py). The phases of a
generation are an enum with asserted transitions (phases.py); docs/live.md draws the whole protocol.
The watchdog, the waits and the progress marks are the process's, reached through the `Host` that
init() hands in (host.py): nothing here imports the rest of lockstep.runtime.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from lockstep.errors import MembershipChanged
from lockstep.runtime.membership import keys
from lockstep.runtime.membership.admission import Admission
from lockstep.runtime.membership.commit import StepCommit
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.formation import Formation
from lockstep.runtime.membership.host import Host, Place
from lockstep.runtime.membership.phases import GenerationPhase
from lockstep.runtime.membership.records import Fault, Membership

P = GenerationPhase
PlaceT = TypeVar("PlaceT", bound=Place)  # runtime's Topology: the group hands back what it was given


class LiveGroup(Generic[PlaceT]):
    """This worker's live membership: the store, the current generation, the faults seen."""

    def __init__(
        self,
        store: Any,
        topo: PlaceT,
        host: Host,
        min_world: int,
        backend: str,
        timeout: timedelta,
        *,
        member_id: int | None = None,
        joining: bool = False,
        attempt: int = 0,
    ) -> None:
        self.topo, self.host, self.min_world = topo, host, min_world
        member_id = topo.rank if member_id is None else member_id
        launched = Membership(0, tuple(range(topo.world_size)), member_id)
        self.state = GroupState(store, launched, P.JOINING if joining else P.FORMING)
        self.formation = Formation(self.state, host, backend, timeout, min_world)
        self.commits = StepCommit(self.state, host)
        self.admission = Admission(self.state)
        self.joining = joining  # a replacement: it queues, and its state comes from a peer
        self.needs_state = joining  # until the trainer received it (state_received)
        self.attempt = (
            attempt  # whole-job restarts before this one (the launcher's, after a job-ending error)
        )
        # The watchdog thread evicts through a connection of its own (a store client is not shared).
        self._evict_store = store.clone() if hasattr(store, "clone") else store
        self.faults: list[Fault] = []
        # where this process runs: members waiting for it to check in look at it (formation.py)
        store.set(keys.whereabouts(member_id), json.dumps(host.whereabouts()))

    @property
    def membership(self) -> Membership:
        return self.state.membership

    @property
    def phase(self) -> GenerationPhase:
        return self.state.phase.phase

    @property
    def launch_world_size(self) -> int:
        """The world the job was launched with (-n times the nodes), whoever is a member now."""
        return self.topo.world_size

    @property
    def abandoned(self) -> int:
        """Groups left with work possibly stuck in them: the process must end with os._exit."""
        return len(self.formation.graveyard)

    def hold_in_groups(self, size: int) -> None:
        """From now on members leave and join in replica groups of `size` (a sharded run: replica_groups.py);
        the launcher reads it too (a group lost costs one replacement: launch/live_account.py)."""
        self.state.group_size = size
        self.state.store.set(keys.GROUP_SIZE, str(size))

    def topology(self) -> PlaceT:
        """The place this process was launched with, numbered as the current generation numbers it."""
        m = self.membership
        # a dataclass (runtime's Topology) that mypy sees only as a TypeVar bound to a Protocol
        return replace(self.topo, rank=m.rank, world_size=m.world_size)  # type: ignore[type-var]

    # ---- forming the first generation -------------------------------------------------------------------

    def form_first(self) -> None:
        """Generation 0 (or, for a replacement, the generation it is admitted to), then the watchdog."""
        self.host.watch(self)
        if self.joining:
            self._join()
        else:
            self._form_generation_zero()
            self.state.phase.enter(P.TRAINING)

    def _form_generation_zero(self) -> None:
        # Generation 0 is agreed like any other: a rank that died before it checked in is left out, and
        # one that dies while the group forms makes the others form generation 1 without it.
        state = self.state
        state.see_changes()
        launched = state.membership
        state.membership = Membership(-1, launched.members, launched.member_id)
        started = time.monotonic()
        cause: BaseException | str = "lost at start-up, before it checked in"
        checkin_s = self.formation.timeout.total_seconds()
        while True:  # launches can be slow: wait for check-ins as long as the group's own timeout
            fault = self.formation.next_generation(launched, cause, (), checkin_s=checkin_s)
            try:
                self.formation.form_group()
                break
            except MembershipChanged as exc:
                cause = exc
        if fault.lost:
            fault.recover_s = time.monotonic() - started
            self.faults.append(fault)

    def _join(self) -> None:
        """A replacement: queue, wait for the members to admit this process, form their generation."""
        self.state.membership = self.admission.wait_for_admission()
        self.state.phase.enter(P.FORMING)
        self.state.see_changes()  # the members' check-ins are counted
        try:
            self.formation.form_group()
        except MembershipChanged as exc:
            # A member died as the group formed: the members form the next generation, and this process
            # is one of them (a member of the generation it was admitted to). It receives the state once
            # they formed, as it would have from this one.
            self.reform(exc)  # ends in TRAINING
            return
        self.state.phase.enter(P.TRAINING)

    # ---- what the waits and the watchdog ask (host.py's Watched) --------------------------------------

    def check(self) -> None:
        """Raise MembershipChanged when a member died or a survivor is re-forming (polled while waiting)."""
        self.state.check()

    def evict(self, rank: int, why: str) -> None:
        """From the watchdog thread: `rank` of the current group stopped answering; name it dead (once)."""
        key = keys.dead(self.membership.members[rank])
        if self._evict_store.check([key]):
            return
        self._evict_store.add(keys.CHANGES, 1)  # counted before marked, as the launcher does
        self._evict_store.compare_set(key, "", f"evicted by the survivors ({why})")

    def dead(self) -> dict[int, str]:
        return self.state.dead()

    # ---- steps ------------------------------------------------------------------------------------------

    def commit(self, step: int, rows: bytes | None = None, *, work: str = "") -> None:
        """The step (or the work between steps `work` names) counts on every member or on none (commit.py)."""
        self.commits.commit(step, rows, work=work)

    def committed_rows(self, generation: int, step: int, member: int) -> bytes | None:
        return self.commits.committed_rows(generation, step, member)

    def forget_rows(self, committed: list[tuple[int, int]]) -> None:
        self.commits.forget_rows(committed)

    def joiners_due(self, step: int, next_step: int | None = None) -> list[int]:
        """The replacements to admit after `step` (admission.py), else []; `next_step`: the next boundary
        at which a growth can happen, when not step + 1."""
        return self.admission.joiners_due(step, next_step)

    def state_received(self) -> None:
        """A replacement holds the run's state from now on: it says so on the store (`healed/<member>`)."""
        self.needs_state = False
        self.state.store.set(keys.healed(self.membership.member_id), str(self.membership.generation))

    # ---- re-forming -------------------------------------------------------------------------------------

    def reform(self, cause: BaseException | str, joiners: list[int] | tuple[int, ...] = ()) -> Fault:
        """Leave the group, agree on the members, form the next generation (see the module doc).
        `joiners`: a planned growth at a step boundary (nothing failed); else a member was lost.
        A member lost while the new group forms makes it try once more without that member."""
        machine = self.state.phase
        machine.enter(P.ADMITTING if joiners else P.LOST)
        if not joiners:
            machine.enter(P.REFORMING)
        started = time.monotonic()
        first = self.membership
        waited = self.host.stop_watchdog()
        if isinstance(cause, BaseException):
            # The failed call's frames hold its Work, and the Work holds the group: let them go.
            traceback.clear_frames(cause.__traceback__)
        self.formation.leave_group()
        left_at = time.monotonic()
        while True:
            fault = self.formation.next_generation(first, cause, joiners)
            agreed_at = time.monotonic()
            try:
                self.formation.form_group()
                break
            except MembershipChanged as exc:  # a member died while the group formed: again without it
                cause, joiners = exc, ()
                machine.enter(P.LOST)
                machine.enter(P.REFORMING)
        self._formed()
        formed_at = time.monotonic()
        fault.recover_s = formed_at - started
        fault.detail = {
            "waited_s": round(waited, 4),
            "leave_s": round(left_at - started, 4),
            "agree_s": round(agreed_at - left_at, 4),
            "new_group_s": round(formed_at - agreed_at, 4),
        }
        self.faults.append(fault)
        return fault

    def _formed(self) -> None:
        """The new generation's group exists: its phase, and the watchdog over it."""
        self.state.phase.enter(P.TRAINING)
        self.host.start_watchdog(self)


def form_live_group(
    topo: PlaceT,
    host: Host,
    backend: str,
    timeout: timedelta,
    *,
    min_world: int,
    member_id: int | None,
    joining: bool,
    attempt: int = 0,
) -> LiveGroup[PlaceT]:
    """Form generation 0 over every launched member, on the launcher's store (called by init())."""
    client = dist.TCPStore(
        topo.master_addr, topo.master_port, topo.world_size, False, timeout, wait_for_workers=False
    )
    group = LiveGroup(
        client,
        topo,
        host,
        min_world,
        backend,
        timeout,
        member_id=member_id,
        joining=joining,
        attempt=attempt,
    )
    group.form_first()
    return group
