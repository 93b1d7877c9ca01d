"""What every part of live membership shares: the store, the current generation, and how changes are counted.

Formation, commit and admission (their own modules) each act on one `GroupState`, which the LiveGroup
(group.py) composes them around. A change of members is counted on the store (`keys.CHANGES`) before it is
written anywhere else, by whoever causes it: the launcher before it marks a worker dead, a survivor before
it checks in to the next generation, a watchdog before it evicts a silent rank. So a member that has seen
the count it agreed on knows that any later count is a new change.
"""

from __future__ import annotations

from typing import Any

from lockstep.errors import MembershipChanged, rank_tag
from lockstep.runtime.membership import keys
from lockstep.runtime.membership.phases import GenerationPhase, PhaseMachine
from lockstep.runtime.membership.records import Membership


class GroupState:
    """The shared state of this worker's live membership."""

    def __init__(self, store: Any, membership: Membership, phase: GenerationPhase) -> None:
        self.store = store
        self.membership = membership
        self.phase = PhaseMachine(phase)
        self.changes_seen = 0
        self.known: set[int] = set(membership.members)  # every member id seen: members and replacements
        self.group_size = 1  # members leave and join in replica groups of this many (replica_groups.py)

    @property
    def tag(self) -> str:
        return rank_tag(self.membership.rank, self.membership.world_size)

    def changes(self) -> int:
        return int(self.store.add(keys.CHANGES, 0))

    def see_changes(self) -> None:
        """Every change behind the generation agreed on is counted by now: a later one is a new change."""
        self.changes_seen = self.changes()

    def changed(self) -> bool:
        return self.changes() != self.changes_seen

    def count_change(self) -> None:
        """This member causes a change (it re-forms, or gives up): whoever waits on it stops waiting."""
        self.store.add(keys.CHANGES, 1)

    def check(self) -> None:
        """Raise MembershipChanged when a member died or a survivor is re-forming (polled while waiting)."""
        if self.changed():
            raise MembershipChanged(
                f"{self.tag}the group lost a member while this rank waited in a collective (generation "
                f"{self.membership.generation})"
            )

    def dead(self) -> dict[int, str]:
        """Member ids known dead (the launcher saw them end, or the survivors evicted them), with how."""
        out = {}
        for member in sorted(self.known):
            key = keys.dead(member)
            if self.store.check([key]):
                out[member] = bytes(self.store.get(key)).decode()
        return out
