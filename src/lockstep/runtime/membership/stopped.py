"""A peer seen stopped: how long, at every look. Live mode's rule for naming a stopped rank lost at once.

A rank whose process this host sees stopped in /proc (SIGSTOP, a debugger) cannot answer, but a stop can be
brief: a py-spy dump stops a process for milliseconds. So a peer counts as lost only once it has been seen
stopped at every look for STOPPED_GRACE seconds, with nothing showing it ran in between: its pid, its count
of context switches (a stop and a start move it) and, where there is one, its heartbeat unchanged. Two
places look: the hang watchdog while this rank waits in a collective (runtime/peer_heartbeats.py), and
formation while the group re-forms and no watchdog runs (formation.py); neither with --hang-timeout 0. A
dead process is never judged here: its launcher marks it dead and knows its signal.
"""

from __future__ import annotations

from collections.abc import Hashable

# A py-spy dump stops a process for milliseconds, well under it; a debugger that holds a rank stopped in
# live mode gets it evicted (docs/hangs.md: debug without --min-world).
STOPPED_GRACE = 1.0


def is_stopped(why: str | None) -> bool:
    """Whether a `Host.gone` answer (or a heartbeat's 'away') says stopped, not dead."""
    return bool(why) and str(why).startswith("stopped")


class StopClock:
    """For each peer, since when it has been seen stopped at every look with the same mark."""

    def __init__(self) -> None:
        self._since: dict[int, tuple[Hashable, float]] = {}

    def look(self, peer: int, stopped: bool, mark: Hashable, now: float) -> float:
        """Record one look at `peer` at `now` (monotonic s); how long it has been stopped, -1.0 when it is
        not. A look that finds it running, or a new `mark` (a new pid or heartbeat: it ran in between, or
        is another process), starts the clock over."""
        if not stopped:
            self._since.pop(peer, None)
            return -1.0
        seen = self._since.get(peer)
        if seen is None or seen[0] != mark:
            seen = self._since[peer] = (mark, now)
        return now - seen[1]
