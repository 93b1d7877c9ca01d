"""The other ranks' heartbeats as the hang watchdog reads them: each rank's latest state, and whether it lives.

A rank's watchdog publishes `hb/<rank>` every tick (and `issued/<rank>` as a collective is issued:
runtime/watchdog.py). `PeerHeartbeats.read` gathers them and marks each rank whose heartbeat stopped
changing for `stale_after` seconds, or whose process this host sees stopped or gone, as 'silent' (with
'liveness': why; and 'away': why, when /proc says so), and a rank whose heartbeat has not changed since
this rank started to look as 'undecided' (too early to tell). stall_verdict.py judges the states;
`surely_lost` says which of them live mode may name lost at once (/proc, not silence, says so).
"""

from __future__ import annotations

import json
import time
from typing import Any

from lockstep.runtime import stall_verdict
from lockstep.runtime.process_inspection import gone, liveness

# Live mode: a peer on this host seen stopped this long, at every look, is lost (a py-spy dump stops one for
# milliseconds, well under it; a debugger that holds it stopped gets it evicted).
STOPPED_GRACE = 1.0


class PeerHeartbeats:
    """What this rank has seen of the others' heartbeats (see the module doc)."""

    def __init__(self, rank: int, world: int, host: str, stale_after: float) -> None:
        self.rank, self.world, self.host, self.stale_after = rank, world, host, stale_after
        # rank -> (its beat, when that value was first read, whether it has changed since we looked)
        self._seen: dict[int, tuple[int, float, bool]] = {}
        # rank -> (its pid, its beat, since when) while /proc shows it stopped at every read
        self._stopped: dict[int, tuple[int, int, float]] = {}

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
        at every read for `grace` s. A process gone is left to its launcher, which marks it dead within
        milliseconds and knows how it died (its signal)."""
        states = self.read(store)
        return {r: s["away"] for r, s in states.items() if s.get("stopped_for", -1.0) >= grace}

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
        self._time_stopped(rank, state, now)
        if not state.get("exited") and (away or unchanged >= self.stale_after):
            state["silent"] = True
            state["liveness"] = away or liveness(state, unchanged)
        elif not state.get("exited") and not seen[2]:
            state["undecided"] = True

    def _time_stopped(self, rank: int, state: dict[str, Any], now: float) -> None:
        """'stopped_for': how long this rank has been seen stopped, at every read since, with one heartbeat."""
        if not str(state.get("away", "")).startswith("stopped"):
            self._stopped.pop(rank, None)
            return
        key = (int(state["pid"]), int(state.get("beat", -1)))
        pid, beat, since = self._stopped.get(rank, (*key, now))
        if (pid, beat) != key:
            since = now
        self._stopped[rank] = (*key, since)
        state["stopped_for"] = now - since
