"""Live mode: when a rank dies, the survivors re-form the default process group among themselves and go on.

Under `lockstep run -n N --min-world M` the launcher (launch/live.py) hosts the c10d store, starts the N
workers and keeps the others running when one dies; it writes `LIVE_DEAD_KEY<rank>` to the store within
its poll interval (0.05 s). Each worker forms generation 0 of the default group over all N ranks under the
store prefix `lockstep/live/gen0`. When a collective fails on a survivor (its peer's sockets closed), the
training loop calls `reform()`:

1. it leaves the broken group without waiting for it (the group object is kept: gloo cannot abort a
   collective and its destructor waits for the abandoned work). Every rank learns of the change within
   10 ms even when its own collective does not fail (it waits on a survivor, not on the dead rank):
   while a collective is waited on, runtime/watchdog.settle polls a counter on the store that the
   launcher bumps when a rank dies and each survivor bumps as it checks in, and raises MembershipChanged;
2. it checks in to generation g+1 and waits until every member of generation g has checked in or is
   known dead (the launcher's key; a member silent past `checkin_timeout` is left out);
3. the first survivor to write `gen<g+1>/members` (compare_set: first writer wins) decides the members,
   in the order of their launch ranks; a worker left out exits at once, below `--min-world` every survivor
   raises WorldTooSmallError;
4. it forms generation g+1 under its own store prefix (reusing a prefix reads the old addresses) and
   restarts the hang watchdog over the new world.

Ranks are renumbered over the survivors (launch rank order); `uid` stays each worker's launch rank. The
loop then redoes its step over the survivors (trainer/live_fit.py).

A rank that stops answering (SIGSTOP, a hard hang) is evicted: when a survivor has waited on it past the
hang timeout and its heartbeat stopped, that survivor's watchdog marks it dead on the store (`evict`),
which is a membership change like any other; the launcher then kills it.

Replacements (`--max-restarts R` beside `--min-world`) grow the group back. A replacement queues on the
store (LIVE_JOIN_KEY) instead of forming generation 0. After each completed step every member calls
`joiners_due(step)`: rank 0 plans a growth for the next step boundary (`gen<g>/grow`); the others read
the plan by then, because that next step's collectives cannot complete before rank 0 wrote it. At that
boundary every member re-forms with the joiners appended (no counter bump: nothing failed), the
joiners read their admission and form the same generation, and the state comes from rank 0 over the new
group (runtime/state_transfer.py).

Generation 0 is agreed the same way (a rank dead before it checked in is left out of it). A member that
dies between the agreement and the new group's formation leaves the others in init_process_group: it is
bounded by form_timeout() (30 s, or the hang timeout when shorter), after which they form the next
generation without it. A step counts on every member or on none (`commit`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

from lockstep.errors import InternalError, MembershipChanged, WorldTooSmallError, rank_tag
from lockstep.runtime import watchdog
from lockstep.runtime.env_contract import (
    LIVE_ADMIT_KEY,
    LIVE_CHANGES_KEY,
    LIVE_CLOSED_KEY,
    LIVE_DEAD_KEY,
    LIVE_JOIN_KEY,
    LIVE_JOIN_VAR,
    LIVE_MIN_WORLD_VAR,
    LIVE_UID_VAR,
)
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.topology import Topology

T = TypeVar("T")
EVICTED_EXIT_CODE = 75  # a worker the survivors left out (it was too late to check in): EX_TEMPFAIL
_PREFIX = "lockstep/live/"


def min_world_from_env(env: Any = None) -> int | None:
    """--min-world of `lockstep run` (live mode), None when the job is not in live mode."""
    raw = (os.environ if env is None else env).get(LIVE_MIN_WORLD_VAR, "")
    return int(raw) if raw else None


@dataclass(frozen=True)
class Membership:
    """One generation of the group: its members' launch ranks (uids), in rank order."""

    generation: int
    members: tuple[int, ...]
    uid: int

    @property
    def rank(self) -> int:
        return self.members.index(self.uid)

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclass
class Fault:
    """A membership change, as the run's summary records it."""

    generation: int
    lost: list[int]  # launch ranks
    how: dict[str, str]  # launch rank -> what the launcher saw ("killed by SIGKILL", "exit code 1")
    world_size: int  # after the change
    cause: str  # the error this rank saw
    kind: str = "lost"  # "lost": members left; "joined": replacements came in (and none left)
    joined: list[int] = field(default_factory=list)  # launch ranks of the replacements admitted
    recover_s: float = 0.0  # from the failed collective to the new group (the loop adds its redo)
    # waited_s: how long this rank waited in the failed collective (for a stopped rank: the detection)
    detail: dict[str, float] = field(default_factory=dict)


class LiveGroup:
    """This worker's side of live mode: the store, the current membership, the faults seen."""

    def __init__(
        self,
        store: Any,
        topo: Topology,
        min_world: int,
        backend: str,
        timeout: timedelta,
        *,
        uid: int | None = None,
        joining: bool = False,
    ) -> None:
        self.store, self.topo, self.min_world = store, topo, min_world
        self.backend, self.timeout = backend, timeout
        uid = topo.rank if uid is None else uid
        self.membership = Membership(0, tuple(range(topo.world_size)), uid)
        self.joining = joining  # a replacement: it queues, and its state comes from a peer
        self.needs_state = joining  # until the trainer received it (state_received)
        self.checkin_timeout = 60.0
        self._graveyard: list[Any] = []  # abandoned groups (see _leave_group); the process ends with os._exit
        self._changes_seen = 0
        self._uids: set[int] = set(range(topo.world_size))  # every launch rank seen: members and replacements
        self._queue: list[int] = []  # rank 0: the join queue's entries read so far (launch ranks)
        self._growth: dict[str, Any] | None = None  # this generation's planned growth
        # The watchdog thread evicts through a connection of its own (a store client is not shared).
        self._evict_store = store.clone() if hasattr(store, "clone") else store
        self.faults: list[Fault] = []

    def form_first(self) -> None:
        watchdog.set_live_hooks(self.check, self.evict)
        if self.joining:
            self._join()
            return
        # Generation 0 is agreed like any other: a rank that died before it checked in is left out, and
        # one that dies while the group forms makes the others form generation 1 without it.
        self._changes_seen = int(self.store.add(LIVE_CHANGES_KEY, 0))
        launched = self.membership
        self.membership = Membership(-1, launched.members, launched.uid)
        started = time.monotonic()
        cause: BaseException | str = "lost at start-up, before it checked in"
        while True:  # launches can be slow: wait for check-ins as long as the group's own timeout
            fault = self._next_generation(launched, cause, (), checkin_s=self.timeout.total_seconds())
            try:
                self._form(self.membership)
                break
            except MembershipChanged as exc:
                cause = exc
        if fault.lost:
            fault.recover_s = time.monotonic() - started
            self.faults.append(fault)

    @property
    def launch_world_size(self) -> int:
        """The world the job was launched with (-n times the nodes), whoever is a member now."""
        return self.topo.world_size

    def check(self) -> None:
        """Raise MembershipChanged when a member died or a survivor is re-forming (polled while waiting)."""
        if int(self.store.add(LIVE_CHANGES_KEY, 0)) != self._changes_seen:
            raise MembershipChanged(
                f"{rank_tag(self.membership.rank, self.membership.world_size)}the group lost a member while "
                f"this rank waited in a collective (generation {self.membership.generation})"
            )

    def evict(self, rank: int, why: str) -> None:
        """From the watchdog thread: `rank` of the current group stopped answering; name it dead (once)."""
        key = f"{LIVE_DEAD_KEY}{self.membership.members[rank]}"
        if self._evict_store.check([key]):
            return
        self._evict_store.add(LIVE_CHANGES_KEY, 1)  # counted before marked, as the launcher does
        self._evict_store.compare_set(key, "", f"evicted by the survivors ({why})")

    @property
    def abandoned(self) -> int:
        """Groups left with work possibly stuck in them: the process must end with os._exit."""
        return len(self._graveyard)

    def _form(self, m: Membership) -> None:
        """init_process_group for generation m, bounded: a member that dies while the group forms leaves
        the others waiting for its address, so they give up after form_timeout() and re-form without it."""
        prefix = dist.PrefixStore(f"{_PREFIX}gen{m.generation}", self.store)
        bounded = min(self.timeout, form_timeout())
        try:
            dist.init_process_group(
                self.backend, store=prefix, rank=m.rank, world_size=m.world_size, timeout=bounded
            )
        except (RuntimeError, dist.DistError) as exc:
            raise MembershipChanged(
                f"{rank_tag(m.rank, m.world_size)}forming generation {m.generation} of the group failed "
                f"({_first_line(exc)}): a member died while it formed"
            ) from exc
        if bounded < self.timeout:
            dist.distributed_c10d._set_pg_timeout(self.timeout)  # collectives keep the job's own timeout

    def topology(self) -> Topology:
        m = self.membership
        return replace(self.topo, rank=m.rank, world_size=m.world_size)

    def dead(self) -> dict[int, str]:
        """Launch ranks known dead (the launcher saw them end, or the survivors evicted them), with how."""
        out = {}
        for uid in sorted(self._uids):
            key = f"{LIVE_DEAD_KEY}{uid}"
            if self.store.check([key]):
                out[uid] = bytes(self.store.get(key)).decode()
        return out

    # ---- committing a step ----------------------------------------------------------------------------------

    def commit(self, step: int, rows: bytes | None = None) -> None:
        """After this rank's collectives of `step` completed: return once every member's did (the step
        counts everywhere), or raise MembershipChanged on every member when one's did not (all redo it).

        A collective can complete on some ranks and fail on others (the dead rank sent its last bytes to
        some peers only), so completion alone would let the members disagree on whether the step
        happened. Each member counts itself done on the store; a step counts when all are. A member
        writes its key before it can die, so when a death is seen the keys are final and every member
        decides the same. One store write and a read or two per step.

        `rows`: this member's metric rows of the step (packed). They are written before its key, so once
        the step counts they stay readable (`committed_rows`) after this member is lost.
        """
        m = self.membership
        prefix = f"{_PREFIX}gen{m.generation}/done/{step}/"
        if rows is not None:
            self.store.set(f"{prefix}{m.uid}/rows", rows)  # on the same connection as the add below
        self.store.add(f"{prefix}{m.uid}", 1)  # answered by the store: written before this rank can die
        keys = [f"{prefix}{u}" for u in m.members]
        # Waited on like a collective: a member stopped between its collectives and its key is judged by
        # the hang watchdog (its heartbeat), and evicted after the hang timeout like in any collective.
        with watchdog.tracked(f"commit (step {step})", ()):
            while not self.store.check(keys):
                if int(self.store.add(LIVE_CHANGES_KEY, 0)) != self._changes_seen:
                    if self.store.check(keys):
                        return
                    raise MembershipChanged(
                        f"{rank_tag(m.rank, m.world_size)}a member left before step {step} completed on "
                        f"every rank (generation {m.generation}): the step is redone"
                    )
                time.sleep(0.0005)

    def committed_rows(self, generation: int, step: int, uid: int) -> bytes | None:
        """The metric rows that member `uid` committed with `step` in `generation`, if it did."""
        key = f"{_PREFIX}gen{generation}/done/{step}/{uid}/rows"
        return bytes(self.store.get(key)) if self.store.check([key]) else None

    def forget_rows(self, committed: list[tuple[int, int]]) -> None:
        """Drop this member's rows of (step, generation) pairs once they are logged: the store stays small."""
        for step, generation in committed:
            self.store.delete_key(f"{_PREFIX}gen{generation}/done/{step}/{self.membership.uid}/rows")

    # ---- replacements -----------------------------------------------------------------------------------

    def _join(self) -> None:
        """A replacement: queue, wait for the members to admit this process, form their generation."""
        uid = self.membership.uid
        position = int(self.store.add(f"{LIVE_JOIN_KEY}count", 1))
        self.store.set(f"{LIVE_JOIN_KEY}{position}", str(uid))
        admit = f"{LIVE_ADMIT_KEY}{uid}"
        while not self.store.check([admit]):
            if self.store.check([LIVE_CLOSED_KEY]):
                sys.stderr.write(
                    f"lockstep: replacement {uid} was not needed: the job ended before it joined\n"
                )
                sys.exit(0)
            time.sleep(0.01)
        g = int(bytes(self.store.get(admit)).decode())
        members = tuple(json.loads(bytes(self.store.get(f"{_PREFIX}gen{g}/members")).decode()))
        self._uids.update(members)
        self.membership = Membership(g, members, uid)
        self._changes_seen = int(self.store.add(LIVE_CHANGES_KEY, 0))  # the members' check-ins are counted
        try:
            self._form(self.membership)
        except MembershipChanged as exc:  # a member died as the group formed: the members go on without
            self.give_up(exc)  # this process, which has no state yet; the launcher may start another

    def joiners_due(self, step: int) -> list[int]:
        """Called by every member after each completed `step`: the replacements to admit now, else [].

        Rank 0 reads the queue and plans the growth for the next boundary; every other member sees that
        plan by then (see the module doc). One store round trip per step.
        """
        m = self.membership
        key = f"{_PREFIX}gen{m.generation}/grow"
        if self._growth is None and m.rank != 0 and self.store.check([key]):
            self._growth = json.loads(bytes(self.store.get(key)).decode())
        if self._growth is None and m.rank == 0:
            queued = self._queued()
            if queued:
                plan = json.dumps({"step": step + 1, "joiners": queued})
                self._growth = json.loads(bytes(self.store.compare_set(key, "", plan)).decode())
        if self._growth is None or self._growth["step"] > step:
            return []
        if self._growth["step"] < step:
            raise InternalError(
                f"{rank_tag(m.rank, m.world_size)}the growth planned for step {self._growth['step']} was "
                f"read at step {step}: the members would form different groups"
            )
        return [int(u) for u in self._growth["joiners"]]

    def _queued(self) -> list[int]:
        """Replacements waiting in the queue (not members, not dead), in the order they queued."""
        count = int(self.store.add(f"{LIVE_JOIN_KEY}count", 0))
        while len(self._queue) < count:  # store.get waits for an entry whose writer is between its two calls
            self._queue.append(int(bytes(self.store.get(f"{LIVE_JOIN_KEY}{len(self._queue) + 1}")).decode()))
        waiting = [u for u in self._queue if u not in self.membership.members]
        if not waiting:
            return []
        self._uids.update(waiting)
        dead = self.dead()
        return [u for u in waiting if u not in dead]

    def state_received(self) -> None:
        self.needs_state = False

    def give_up(self, cause: BaseException) -> NoReturn:
        """A replacement that lost its peer before it had the state: leave (marked dead, so the members
        do not wait for it); the launcher may start another replacement."""
        uid = self.membership.uid
        self.store.add(LIVE_CHANGES_KEY, 1)
        self.store.compare_set(
            f"{LIVE_DEAD_KEY}{uid}", "", f"gave up: lost its peer while healing ({_first_line(cause)})"
        )
        sys.stderr.write(
            f"lockstep: replacement {uid} lost its peer before it received the state; it exits\n"
        )
        sys.stderr.flush()
        os._exit(EVICTED_EXIT_CODE)

    # ---- re-forming ---------------------------------------------------------------------------------------

    def reform(self, cause: BaseException | str, joiners: list[int] | tuple[int, ...] = ()) -> Fault:
        """Leave the group, agree on the members, form the next generation (see the module doc).
        `joiners`: a planned growth at a step boundary (nothing failed); else a member was lost.
        A member lost while the new group forms makes it try once more without that member."""
        started = time.monotonic()
        first = self.membership
        waited = time.time() - PROGRESS.wait_since if PROGRESS.waiting is not None else 0.0
        watchdog.stop()
        if isinstance(cause, BaseException):
            # The failed call's frames hold its Work, and the Work holds the group: let them go.
            traceback.clear_frames(cause.__traceback__)
        self._leave_group()
        left_at = time.monotonic()
        while True:
            fault = self._next_generation(first, cause, joiners)
            agreed_at = time.monotonic()
            try:
                self._form(self.membership)
                break
            except MembershipChanged as exc:  # a member died while the group formed: again without it
                cause, joiners = exc, ()
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

    def _next_generation(
        self,
        first: Membership,
        cause: BaseException | str,
        joiners: list[int] | tuple[int, ...],
        checkin_s: float | None = None,
    ) -> Fault:
        """Check in to the generation after the current one and agree on its members; the Fault counts
        who left and joined since `first` (the members before the change). `checkin_s`: at start-up,
        how long to wait for the others (else checkin_timeout); nobody waits in a collective yet then."""
        old = self.membership
        g = old.generation + 1
        if not joiners and checkin_s is None:
            # A growth bumps nothing: a peer finishing its last collective must not abandon it. Else,
            # before checking in: whoever waits on this rank stops waiting.
            self.store.add(LIVE_CHANGES_KEY, 1)
        members = self._check_in(old, g, joiners, checkin_s or self.checkin_timeout)
        lost = [u for u in first.members if u not in members]
        joined = [u for u in members if u not in first.members]
        for uid in joined:
            self.store.set(f"{LIVE_ADMIT_KEY}{uid}", str(g))  # every member writes it: the same value
        self.membership = Membership(g, members, old.uid)
        how = self.dead()
        fault = Fault(
            generation=g,
            lost=lost,
            how={str(u): how.get(u, "did not check in") for u in lost},
            world_size=len(members),
            cause=_first_line(cause),
            kind="lost" if lost else "joined",
            joined=joined,
        )
        if len(members) < self.min_world:
            raise WorldTooSmallError(
                f"{rank_tag(self.membership.rank, len(members))}launch ranks {lost} left the job "
                f"({_describe(fault.how)}); {len(members)} remain, fewer than --min-world {self.min_world}: "
                "the job ends. Its last checkpoint is intact; resume from it, or lower --min-world"
            )
        return fault

    def _check_in(
        self, old: Membership, g: int, joiners: list[int] | tuple[int, ...], wait_s: float
    ) -> tuple[int, ...]:
        """Check in to generation g, agree on its members; leave the job if left out of them."""
        self.store.set(f"{_PREFIX}gen{g}/in/{old.uid}", "1")
        members = self._agree(old, g, joiners, wait_s)
        self._growth = None
        # Every change behind this generation is counted by now (the launcher counts a death before it
        # marks the rank dead, a survivor before it checks in): a later change is a new fault.
        self._changes_seen = int(self.store.add(LIVE_CHANGES_KEY, 0))
        if old.uid not in members:
            sys.stderr.write(
                f"lockstep: rank {old.uid} (launch rank) was left out of the group by the survivors "
                f"(generation {g}: {list(members)}); it exits\n"
            )
            sys.stderr.flush()
            os._exit(EVICTED_EXIT_CODE)
        return members

    def _formed(self) -> None:
        """The new generation's group exists: the process-wide view of it, the watchdog over it."""
        from lockstep.runtime.process_group import rebind_view  # it imports this module

        rebind_view(self.membership.rank, self.membership.world_size)
        PROGRESS.failed = None
        PROGRESS.waiting = None
        watchdog.start(watchdog_timeout(), _report_dir(), live=True)

    def _leave_group(self) -> None:
        """Leave the broken group without waiting for it: work abandoned in it may never finish (gloo has
        no abort, and its destructor waits for pending work), so the group object is kept referenced."""
        if dist.is_initialized():
            self._graveyard.append(dist.group.WORLD)
            dist.destroy_process_group()

    def _agree(
        self, old: Membership, g: int, joiners: list[int] | tuple[int, ...], wait_s: float
    ) -> tuple[int, ...]:
        deadline = time.monotonic() + wait_s
        checked: set[int] = {old.uid}
        while True:
            dead = self.dead()
            for uid in old.members:
                if uid not in checked and self.store.check([f"{_PREFIX}gen{g}/in/{uid}"]):
                    checked.add(uid)
            waiting = [u for u in old.members if u not in checked and u not in dead]
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        self._uids.update(joiners)
        proposal = json.dumps(sorted(checked) + [u for u in joiners if u not in self.dead()])
        agreed = self.store.compare_set(f"{_PREFIX}gen{g}/members", "", proposal)
        return tuple(json.loads(bytes(agreed).decode()))


_live: LiveGroup | None = None


def current() -> LiveGroup | None:
    """This worker's LiveGroup in live mode (after init()), else None."""
    return _live


def retry_start(work: Callable[[], T]) -> T:
    """work() with collectives at start-up (replicating a model, loading a checkpoint), done again over
    the survivors when a member is lost in it. Outside live mode: work() once."""
    while True:
        try:
            return work()
        except (RuntimeError, dist.DistError) as exc:
            group = _live
            if group is None:
                raise
            before = group.membership.members
            group.reform(exc)
            if group.membership.members == before and not isinstance(exc, MembershipChanged):
                raise  # nobody left: the error is the program's own


def form(topo: Topology, backend: str, timeout: timedelta, min_world: int) -> LiveGroup:
    """Form generation 0 over every launch rank, on the launcher's store (called by init())."""
    global _live
    client = dist.TCPStore(
        topo.master_addr, topo.master_port, topo.world_size, False, timeout, wait_for_workers=False
    )
    env = os.environ
    uid = int(env[LIVE_UID_VAR]) if env.get(LIVE_UID_VAR) else None
    _live = LiveGroup(
        client, topo, min_world, backend, timeout, uid=uid, joining=env.get(LIVE_JOIN_VAR) == "1"
    )
    _live.form_first()
    return _live


FORM_TIMEOUT_S = 30.0  # longest wait for a new group to form (below the 60 s check-in timeout)


def form_timeout() -> timedelta:
    """How long a new generation may take to form: 30 s, or the hang timeout when that is shorter."""
    hang = watchdog_timeout()
    return timedelta(seconds=min(FORM_TIMEOUT_S, hang) if hang > 0 else FORM_TIMEOUT_S)


def watchdog_timeout() -> float:
    from lockstep.runtime.process_group import hang_timeout_setting

    return hang_timeout_setting()


def _report_dir() -> str | None:
    from lockstep.runtime.topology import report_dir_from_env

    return report_dir_from_env(os.environ)


def _first_line(cause: BaseException | str) -> str:
    text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
    return text.strip().splitlines()[0] if text.strip() else ""


def _describe(how: dict[str, str]) -> str:
    return "; ".join(f"rank {u} {what}" for u, what in how.items())
