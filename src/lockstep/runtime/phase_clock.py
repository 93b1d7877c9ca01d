"""Time per phase per step on the main thread, kept in a fixed ring, summarised for the straggler reports.

The main thread calls `switch` on every phase change, `begin_wait`/`end_wait` around every collective it
blocks on and `close_step` when a step begins (runtime/progress.py does, through `Progress`): each is a
perf_counter() read and a few float additions into preallocated arrays, nothing allocated per step.
A step is what `Progress.step` counts (a synced forward starts one); the time from one step's start to the
next one's is the step's time, whatever phases it passed through (data loading before the forward counts
in the step before it, on every rank alike).

Each phase's time is split into the time waited in collectives during it and the rest, the busy time:
what a rank spends on its own work. The watchdog thread calls `summary` each tick (runtime/straggler_reports.py
publishes it): medians over the last WINDOW closed steps, so a few slow steps do not move it.

When a run's timeline is open (runtime/timeline/recorder.py), the clock also hands it each of these events
with the time it read: `timeline` is None otherwise, and then that costs one attribute check.
"""

from __future__ import annotations

import statistics
from array import array
from time import perf_counter
from typing import Any

MAX_PHASES = 16  # distinct phase names timed apart; later names share the last slot, OTHER
OTHER = "other"
RING = 64  # closed steps kept
WINDOW = 15  # steps a summary covers (the latest ones); odd: a median is one step's value, not a mean of two
SKIP_STEPS = 2  # the first steps (compilation, bucket rebuild) say nothing about a rank's speed
_ROW = 2 + 2 * MAX_PHASES  # step number, step seconds, then per phase: seconds in it, seconds waited in it
_ZEROS = array("d", [0.0] * (2 * MAX_PHASES))  # arrays of doubles: copied into, never reallocated


class PhaseClock:
    """Per-phase time of the current step and a ring of closed steps; written by the main thread only."""

    __slots__ = (
        "_acc",
        "totals",
        "_cur",
        "_partial",
        "_since",
        "_slots",
        "_step_start",
        "_wait_start",
        "closed",
        "enabled",
        "names",
        "ring",
        "timeline",
    )

    def __init__(self, phase: str) -> None:
        self.enabled = (
            True  # off only to measure what the accounting costs (benchmarks/straggler_overhead.py)
        )
        self.names: list[str] = []  # slot -> phase name
        self._slots: dict[str, int] = {}
        self._acc = array("d", _ZEROS)
        # seconds in each phase since the clock began, never reset (runtime/run_account.py reads the lost ones)
        self.totals = array("d", [0.0] * MAX_PHASES)
        self.ring = [array("d", [-1.0] * _ROW) for _ in range(RING)]
        self.closed = 0  # steps closed so far (the ring holds the last RING of them)
        now = perf_counter()
        self._cur = self.slot(phase)
        self._since = self._step_start = now
        self._wait_start = 0.0
        self._partial = False  # the current step began while the clock was off: not recorded
        self.timeline: Any = None  # runtime/timeline/recorder.py's Timeline while one records this clock

    def slot(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None:
            if len(self.names) >= MAX_PHASES - 1:
                if len(self.names) == MAX_PHASES - 1:
                    self.names.append(OTHER)
                return MAX_PHASES - 1
            slot = self._slots[name] = len(self.names)
            self.names.append(name)
        return slot

    def set_enabled(self, on: bool) -> None:
        """Switch the accounting on or off (benchmarks/straggler_overhead.py). A step that was under way
        when it was switched on is not recorded: part of it went untimed."""
        if on and not self.enabled:
            self._partial, self._wait_start = True, 0.0
        self.enabled = on

    # ------------------------------------------------------------------ the main thread

    def switch(self, name: str) -> None:
        now = perf_counter()
        self._acc[self._cur] += now - self._since
        self.totals[self._cur] += now - self._since
        self._since = now
        slot = self._slots.get(name)
        self._cur = slot if slot is not None else self.slot(name)
        timeline = self.timeline
        if timeline is not None:
            timeline.phase(now, self._cur)

    def begin_wait(self, op: str = "") -> None:
        now = self._wait_start = perf_counter()
        timeline = self.timeline
        if timeline is not None:
            timeline.wait(now, op)

    def end_wait(self) -> None:
        if self._wait_start:
            now = perf_counter()
            self._acc[MAX_PHASES + self._cur] += now - self._wait_start
            self._wait_start = 0.0
            timeline = self.timeline
            if timeline is not None:
                timeline.end_wait(now)

    def close_step(self, step: int) -> None:
        """`step` has ended (the next one begins now): its times go into the ring."""
        now = perf_counter()
        timeline = self.timeline
        if timeline is not None:
            timeline.step(now, step + 1)
        acc = self._acc
        if self._partial:
            self._partial = False
            acc[:] = _ZEROS
            self._since = self._step_start = now
            return
        acc[self._cur] += now - self._since
        self.totals[self._cur] += now - self._since
        row = self.ring[self.closed % RING]
        row[0] = -1.0  # a reader that copies the row meanwhile skips it
        row[1] = now - self._step_start
        row[2:] = acc
        row[0] = float(step)
        acc[:] = _ZEROS
        self._since = self._step_start = now
        self.closed += 1

    # ------------------------------------------------------------------ the watchdog thread

    def summary(self, window: int = WINDOW) -> dict[str, Any] | None:
        """Medians over the last `window` closed steps (ms): step time, busy time (step minus waits), busy
        time per phase; None until that many steps (past the first SKIP_STEPS) are closed."""
        closed = self.closed
        rows = [list(self.ring[i % RING]) for i in range(max(0, closed - window), closed)]
        rows = [r for r in rows if r[0] > SKIP_STEPS]
        if len(rows) < window:
            return None
        names = list(self.names)
        waits = [sum(r[2 + MAX_PHASES : 2 + MAX_PHASES + len(names)]) for r in rows]
        phases: dict[str, float] = {}
        for slot, name in enumerate(names):
            busy = statistics.median(r[2 + slot] - r[2 + MAX_PHASES + slot] for r in rows)
            if busy > 0.0:
                phases[name] = round(busy * 1e3, 3)
        return {
            "first": int(rows[0][0]),
            "last": int(rows[-1][0]),
            "step_ms": round(statistics.median(r[1] for r in rows) * 1e3, 3),
            "busy_ms": round(statistics.median(r[1] - w for r, w in zip(rows, waits)) * 1e3, 3),
            "phases": phases,
        }
