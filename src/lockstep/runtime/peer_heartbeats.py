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

# Live mode: a peer on this host whose process has stayed stopped this long is lost (a py-spy dump or a
# debugger's attach stops one for milliseconds, well under it).
STOPPED_GRACE = 1.0


class PeerHeartbeats:
    """What this rank has seen of the others' heartbeats (see the module doc)."""

    def __init__(self, rank: int, world: int, host: str, stale_after: float) -> None:
        self.rank, self.world, self.host, self.stale_after = rank, world, host, stale_after
        # rank -> (its beat, when that value was first read, whether it has changed since we looked)
        self._seen: dict[int, tuple[int, float, bool]] = {}

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

    def surely_lost(self, store: Any, tick: float) -> dict[int, str]:
        """The ranks `surely_lost` names lost, and why; `tick`: how long before it stopped a peer may have
        published its last heartbeat."""
        states, now = self.read(store), time.time()
        found = {rank: surely_lost(state, now, STOPPED_GRACE + tick) for rank, state in states.items()}
        return {rank: why for rank, why in found.items() if why}

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
            state["away"] = away  # certain, not a guess from silence (the watchdog may act on it at once)
        if not state.get("exited") and (away or unchanged >= self.stale_after):
            state["silent"] = True
            state["liveness"] = away or liveness(state, unchanged)
        elif not state.get("exited") and not seen[2]:
            state["undecided"] = True


def surely_lost(state: dict[str, Any], now: float, stopped_for: float) -> str | None:
    """Why the rank of `state` (as `PeerHeartbeats.read` marked it) is lost for certain, None when that is
    not known: /proc on this host shows its process stopped, with its last heartbeat at least `stopped_for`
    s old (`now` and the heartbeat's time are this host's clock: the peer runs here). A process gone is
    left to its launcher, which marks it dead within milliseconds and knows how it died (its signal)."""
    away = str(state.get("away") or "")
    if away.startswith("stopped") and now - float(state.get("t") or now) >= stopped_for:
        return away
    return None
