"""Replacements grow the group back: they queue on the store and are admitted at a step boundary.

A replacement (`lockstep run --max-restarts R` beside `--min-world`) queues (`join/count`, `join/<n>`)
instead of forming generation 0, and waits for `admit/<member>`: the generation it joins. After each
completed step every member asks `joiners_due(step)`: rank 0 reads the queue and plans a growth for the
next step boundary (`gen<g>/grow`, compare_set); the other members read that plan by then, because that
next step's collectives cannot complete before rank 0 wrote it. At that boundary every member re-forms
with the joiners appended (formation.py; nothing failed, so no change is counted), writes their
`admit/<member>`, and the joiners form the same generation; the state then comes from rank 0 over the new
group (runtime/state_transfer.py). A replacement that the job ended before admitting is told so through
`closed` and exits 0; one whose admitted generation loses a member before it has the state re-forms with
the members, as one of them, and receives the state over the next generation (recovery.py).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from lockstep.errors import InternalError
from lockstep.runtime.membership import keys
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.records import Membership
from lockstep.runtime.membership.replica_groups import whole_groups


class Admission:
    """Both sides of admitting replacements: the queue read by the members, the wait of a replacement."""

    def __init__(self, state: GroupState) -> None:
        self.state = state
        self._queue: list[int] = []  # rank 0: the join queue's entries read so far (member ids)
        self._plan: tuple[int, dict[str, Any]] | None = None  # (generation, its planned growth)

    # ---- the replacement's side -----------------------------------------------------------------------

    def wait_for_admission(self) -> Membership:
        """Queue, and wait until the members admit this process; the generation it joins."""
        state = self.state
        member = state.membership.member_id
        position = int(state.store.add(keys.JOIN_COUNT, 1))
        state.store.set(keys.join_entry(position), str(member))
        admit = keys.admit(member)
        while not state.store.check([admit]):
            if state.store.check([keys.CLOSED]):
                sys.stderr.write(
                    f"lockstep: replacement {member} was not needed: the job ended before it joined\n"
                )
                sys.exit(0)
            time.sleep(0.01)
        g = int(bytes(state.store.get(admit)).decode())
        members = tuple(json.loads(bytes(state.store.get(keys.members(g))).decode()))
        state.known.update(members)
        return Membership(g, members, member)

    # ---- the members' side ----------------------------------------------------------------------------

    def joiners_due(self, step: int, next_step: int | None = None) -> list[int]:
        """Called by every member after each completed `step`: the replacements to admit now, else [].

        Rank 0 reads the queue and plans the growth for the next boundary; every other member sees that
        plan by then (see the module doc). One store round trip per step. `next_step`: that boundary
        when it is not the next step, and the members call this only at boundaries (a low-communication
        run: its replacements join at a round's end, and the next round's outer sync is the first
        collective that cannot complete before rank 0 wrote the plan).
        """
        state = self.state
        m = state.membership
        plan = self._plan[1] if self._plan is not None and self._plan[0] == m.generation else None
        key = keys.growth(m.generation)
        if plan is None and m.rank != 0 and state.store.check([key]):
            plan = json.loads(bytes(state.store.get(key)).decode())
        if plan is None and m.rank == 0:
            queued = whole_groups(self._queued(), state.group_size)  # a sharded run's joiners: whole groups
            if queued:
                boundary = step + 1 if next_step is None else next_step
                proposal = json.dumps({"step": boundary, "joiners": queued})
                plan = json.loads(bytes(state.store.compare_set(key, "", proposal)).decode())
        if plan is not None:
            self._plan = (m.generation, plan)
        if plan is None or plan["step"] > step:
            return []
        if plan["step"] < step:
            raise InternalError(
                f"{state.tag}the growth planned for step {plan['step']} was read at step {step}: the members "
                "would form different groups"
            )
        return [int(member) for member in plan["joiners"]]

    def _queued(self) -> list[int]:
        """Replacements waiting in the queue (not members, not dead), in the order they queued."""
        state = self.state
        count = int(state.store.add(keys.JOIN_COUNT, 0))
        while len(self._queue) < count:  # store.get waits for an entry whose writer is between its two calls
            entry = state.store.get(keys.join_entry(len(self._queue) + 1))
            self._queue.append(int(bytes(entry).decode()))
        waiting = [m for m in self._queue if m not in state.membership.members]
        if not waiting:
            return []
        state.known.update(waiting)
        dead = state.dead()
        return [m for m in waiting if m not in dead]
