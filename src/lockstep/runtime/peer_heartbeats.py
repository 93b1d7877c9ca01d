"""The other ranks' heartbeats as the hang watchdog reads them: each rank's latest state, and whether it lives.

A rank's watchdog publishes `hb/<rank>` every tick (and `issued/<rank>` as a collective is issued:
runtime/watchdog.py). `PeerHeartbeats.read` gathers them and marks each rank whose heartbeat stopped
changing for `stale_after` seconds, or whose process this host sees stopped or gone, as 'silent' (with
'liveness': why; and 'away': why, when /proc says so), and a rank whose heartbeat has not changed since
this rank started to look as 'undecided' (too early to tell). stall_verdict.py judges the states;
`surely_lost` says which of them live mode may name lost at once (/proc, not silence, says so:
runtime/membership/stopped.py's rule). It runs at every tick of every wait, so it reads /proc first, with
the pids learned once, and the store only for a peer seen stopped: no O(world) store reads per tick.
"""

from __future__ import annotations

import json
import time
from typing import Any

from lockstep.runtime import stall_verdict
from lockstep.runtime.membership.stopped import STOPPED_GRACE, StopClock, is_stopped
from lockstep.runtime.process_inspection import (
    gone,
    liveness,
    process_state,
    seen_here,
    times_switched,
)

__all__ = ["STOPPED_GRACE", "PeerHeartbeats"]


class PeerHeartbeats:
    """What this rank has seen of the others' heartbeats (see the module doc)."""

    def __init__(self, rank: int, world: int, host: str, stale_after: float) -> None:
        self.rank, self.world, self.host, self.stale_after = rank, world, host, stale_after
        # rank -> (its beat, when that value was first read, whether it has changed since we looked)
        self._seen: dict[int, tuple[int, float, bool]] = {}
        self._stopped = StopClock()  # keyed by rank, marked by its pid, its beat, its context switches
        self._local: dict[int, int] = {}  # rank -> its pid, for the peers on this host (surely_lost)
        self._placed: set[int] = set()  # the ranks whose host is known (from a heartbeat with one)

    def read(self, store: Any) -> dict[int, dict[str, Any]]:
        """Every other rank's latest heartbeat from `store`, marked 'silent' or 'undecided' (module doc)."""
        keys = [f"{kind}/{r}" for kind in ("hb", "issued") for r in range(self.world) if r != self.rank]
        present = [k for k in keys if store.check([k])]
        values = dict(zip(present, store.multi_get(present))) if present else {}
        now = time.monotonic()
        states: dict[int, dict[str, Any]] = {}
        for rank in range(self.world):
            if rank == self.rank:
                continue
            raw = values.get(f"hb/{rank}")
            state: dict[str, Any] = json.loads(raw) if raw else {"rank": rank, "beat": -1, "phase": "?"}
            issued = values.get(f"issued/{rank}")
            if issued:
                stall_verdict.merge_issued(state, json.loads(issued))
            self._mark(rank, state, now)
            states[rank] = state
        return states

    def surely_lost(self, store: Any, grace: float = STOPPED_GRACE) -> dict[int, str]:
        """The ranks lost for certain, and why: on this host, seen stopped in /proc, with the same heartbeat,
        at every look for `grace` s. A process gone is left to its launcher, which marks it dead within
        milliseconds and knows how it died (its signal). Store reads: the heartbeats of ranks not yet
        placed (a host and pid: once each, as a generation's ranks keep their processes) and of a peer
        seen stopped (its beat says whether it ran in between)."""
        self._place(store)
        now = time.monotonic()
        lost: dict[int, str] = {}
        for rank, pid in self._local.items():
            if process_state(pid) not in ("T", "t"):
                self._stopped.look(rank, False, None, now)
                continue
            state = json.loads(store.get(f"hb/{rank}"))
            away = gone(state, self.host)
            if self._time_stopped(rank, state, now, away) >= grace and away:
                lost[rank] = away
        return lost

    def _place(self, store: Any) -> None:
        """Learn the host and pid of each rank not placed yet, from its heartbeat (once it has one)."""
        unplaced = [f"hb/{r}" for r in range(self.world) if r != self.rank and r not in self._placed]
        present = [k for k in unplaced if store.check([k])]
        for key, raw in zip(present, store.multi_get(present) if present else []):
            state = json.loads(raw)
            if state.get("host") is None or state.get("pid") is None:
                continue
            rank = int(key.split("/")[1])
            self._placed.add(rank)
            if seen_here(state, self.host):
                self._local[rank] = int(state["pid"])

    def _mark(self, rank: int, state: dict[str, Any], now: float) -> None:
        beat = int(state.get("beat", -1))
        seen = self._seen.get(rank)
        if seen is None:
            seen = self._seen[rank] = (beat, now, False)
        elif seen[0] != beat:
            seen = self._seen[rank] = (beat, now, True)
        unchanged = now - seen[1]
        away = gone(state, self.host)
        if away:
            state["away"] = away  # certain, not a guess from silence
        self._time_stopped(rank, state, now, away)
        if not state.get("exited") and (away or unchanged >= self.stale_after):
            state["silent"] = True
            state["liveness"] = away or liveness(state, unchanged)
        elif not state.get("exited") and not seen[2]:
            state["undecided"] = True

    def _time_stopped(self, rank: int, state: dict[str, Any], now: float, away: str | None) -> float:
        """How long this rank has been seen stopped, at every look since, with one pid, heartbeat and count
        of context switches (it did not run in between); also its state's 'stopped_for' (-1.0: not stopped)."""
        stopped = is_stopped(away)
        pid = int(state.get("pid") or 0)
        mark = (pid, int(state.get("beat", -1)), times_switched(pid) if stopped else None)
        stopped_for = self._stopped.look(rank, stopped, mark, now)
        if stopped_for >= 0:
            state["stopped_for"] = stopped_for
        return stopped_for
