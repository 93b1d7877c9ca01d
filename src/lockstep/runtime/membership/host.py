"""What a live group needs from the process it runs in: the `Host` it is handed, and the `Place` it renumbers.

Live membership sits below the rest of lockstep.runtime and imports none of it: runtime's process_group
forms the group (init() under `lockstep run --min-world`) and hands it a Host, runtime/live_host.py's
`ProcessHost`, which reaches the hang watchdog, the collective waits, this process's progress marks and
two collectives for it. The group's Topology comes in the same way: any frozen dataclass with the fields
of a `Place` (runtime's Topology), renumbered with `dataclasses.replace` for each generation.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol


class Place(Protocol):
    """This process's place in the job as the group reads it (runtime.topology.Topology has these)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def master_addr(self) -> str: ...

    @property
    def master_port(self) -> int: ...


class Watched(Protocol):
    """A live group as the waits and the hang watchdog see it (runtime.watchdog.MembershipWatch)."""

    min_world: int  # the survivors go on while this many remain (straggler eviction keeps to it)

    def check(self) -> None:
        """Raise MembershipChanged when the group lost a member (polled while a collective is waited on)."""

    def evict(self, rank: int, why: str) -> None:
        """From the watchdog thread: `rank` of the current group stopped answering; name it dead (once)."""


class Host(Protocol):
    """The process around a live group (see the module doc)."""

    def hang_timeout(self) -> float:
        """Seconds a rank may wait for a peer before the hang watchdog acts (0: off)."""

    def tracked(self, op: str) -> AbstractContextManager[object]:
        """A wait of the protocol's own (a step's commit), watched by the hang watchdog like a collective."""

    def recovering(self) -> AbstractContextManager[object]:
        """The span of a re-formation (after a loss, or to let replacements in): the run's time account
        counts it as lost to re-forming (runtime/run_account.py)."""

    def watch(self, group: Watched) -> None:
        """From now on, every collective wait polls `group.check()` (a lost member ends it at once)."""

    def stop_watchdog(self) -> float:
        """Stop the hang watchdog before the group is left; the seconds the main thread had been waiting
        in a collective (0.0 when it was not)."""

    def start_watchdog(self, group: Watched) -> None:
        """The next generation formed: forget the failed collective, watch the new group for hangs."""

    def note_change(self, record: dict[str, Any]) -> None:
        """A membership change happened (the run's record of it: runtime/membership/records.py's Fault),
        for the process's timeline of the run."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's `obj`, in rank order (a collective of the current generation)."""

    def broadcast_state(self, state: Any, src: int) -> Any:
        """`src`'s state (a tree of tensors and objects) on every member; time lost to state transfer."""

    def whereabouts(self) -> dict[str, Any]:
        """Where this process runs (its host and pid), for the others to look at it (`gone`)."""

    def gone(self, whereabouts: dict[str, Any]) -> str | None:
        """Why the process at `whereabouts` cannot answer (stopped or dead), when this host can see it;
        None when it runs, or runs elsewhere."""

    def times_switched(self, whereabouts: dict[str, Any]) -> int | None:
        """A count that moves whenever the process at `whereabouts` runs (its context switches), when this
        host can see it; None otherwise. Two looks that see it stopped with one count saw one stop."""
