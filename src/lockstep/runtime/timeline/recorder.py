"""This process's timeline: its main thread's phases, collective waits and steps, and the events marked on it.

Once `TIMELINE.open(run_dir, track=..., key=...)` is called, the PhaseClock of runtime/progress.py hands it
every phase change, blocking wait and step boundary as a (perf_counter time, code) pair written into a
preallocated ring (the codes: trace.py): no allocation per step, and before `open` nothing at all (the
clock checks one attribute). What is kept is bounded however long the run: the last RECENT steps, windows
of WINDOW steps around each notable mark (copied out of the ring when they close), the marks, and coarse
activity spans for the whole run (activity.py). The part is written to `run_dir/trace/<key>.json` every
FLUSH_S seconds at a step boundary, at the first step boundary after a fault or membership change, and at
exit; trace.py merges the parts into one Chrome trace.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from array import array
from collections import deque
from pathlib import Path
from time import perf_counter
from typing import Any

from lockstep.runtime.phase_clock import MAX_PHASES, PhaseClock
from lockstep.runtime.timeline.activity import ActivitySpans, Marks
from lockstep.runtime.timeline.trace import FORMAT, STEP_CODE, WAIT_END

RING = 32768  # records kept in the ring (a power of two)
_MASK = RING - 1
BOUNDS = 4096  # step boundaries whose ring positions are kept (a power of two)
_BOUNDS_MASK = BOUNDS - 1
RECENT = 200  # steps of the recent past a part keeps
WINDOW = 10  # steps kept before and after each notable mark
MAX_WINDOWS, FIRST_WINDOWS = 40, 8  # past that, the oldest window after the first 8 goes
MAX_CHUNK = 2048  # records in one window (a step with hundreds of waits must not make a part huge)
MAX_RECENT = 8192  # records in the recent chunk
MAX_OPS = 255  # distinct collective names; later ones share the last id
FLUSH_S = 2.0  # a killed rank's part ends at most this long before its death; a write costs 2-3 ms
WINDOW_KINDS = frozenset({"fault", "membership", "replacement", "straggler", "restart"})
URGENT_KINDS = frozenset({"fault", "membership", "replacement", "restart"})  # written at the next step
_NEVER = 1 << 62


class Timeline:
    """The recorder: its hot-path methods (`phase`, `wait`, `end_wait`, `step`) run on the main thread only,
    called by the PhaseClock it is attached to; `mark` may be called from any thread."""

    def __init__(self) -> None:
        self._t = array("d", [0.0] * RING)
        self._c = array("q", [0] * RING)
        self._at = array("q", [0] * BOUNDS)  # ring index (absolute) of each step boundary
        self._clock: PhaseClock | None = None
        self._inbox: deque[tuple[Any, ...]] = deque()  # marks from any thread, taken at a step boundary
        self._exit_hook = False
        self._reset(None, "", "", RECENT, WINDOW)

    def _reset(self, run_dir: Path | None, track: str, key: str, recent: int, window: int) -> None:
        self.run_dir, self.track, self.key = run_dir, track, key
        self.recent, self.window = max(recent, 2 * window + 2), window
        self._n = 0  # records written so far (the ring holds the last RING of them)
        self._nb = 0  # step boundaries so far
        self._step = 0  # the step under way
        self._ops: dict[str, int] = {}
        self._op_names: list[str] = []
        self._kind_of = [-1] * MAX_PHASES  # phase slot -> activity id (-1: not looked up yet)
        self.spans = ActivitySpans()
        self.marks = Marks()
        self._inbox.clear()
        self._windows: list[tuple[int, int, str]] = []  # closed windows: ring indices, the chunk in JSON
        self._open: list[list[int]] = []  # [start boundary, end boundary, ring index at the mark]
        self.dropped_windows = 0
        self._copied_to = 0  # ring index up to which records went into windows
        self._due = 0  # step boundary count at which `_service` runs next (0: at the first)
        self._due_time = 0.0
        self.perf_origin = perf_counter()
        self.origin_wall = time.time()  # wall = origin_wall + (perf_counter() - perf_origin)
        self._first_t = self._last_t = -1.0
        self.write_error: str | None = None  # why the last write at a step boundary failed, if it did

    # ------------------------------------------------------------------ opening and closing

    def open(
        self,
        run_dir: Path | str,
        *,
        track: str,
        key: str,
        clock: PhaseClock | None = None,
        recent: int = RECENT,
        window: int = WINDOW,
    ) -> None:
        """Record from now on and write this process's part to run_dir/trace/<key>.json. `track` names the
        process in the trace ("rank 0 (member 0)"); `key` is unique per process and attempt. `clock`: the
        PhaseClock to record from (PROGRESS.clock). Opening again starts afresh."""
        step = 0
        if clock is None:
            from lockstep.runtime.progress import PROGRESS

            clock, step = PROGRESS.clock, PROGRESS.step
        self.set_enabled(False)
        self._reset(Path(run_dir), track, key, min(recent, BOUNDS - 2 * window - 2), window)
        self._step = step  # a resumed run's step under way, until the next step boundary
        (Path(run_dir) / "trace").mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self.phase(self.perf_origin, clock._cur)  # the phase under way
        self.set_enabled(True)
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(self._flush_at_exit)

    @property
    def opened(self) -> bool:
        return self.run_dir is not None

    def set_enabled(self, on: bool) -> None:
        """Attach to the clock (record) or detach (record nothing); benchmarks/timeline_overhead.py compares."""
        if self._clock is not None:
            self._clock.timeline = self if on and self.opened else None

    def close(self) -> None:
        """Write the part one last time and stop recording (the run is over); detached even when the
        write fails (OSError propagates)."""
        try:
            if self.opened:
                self.flush()
        finally:
            self.set_enabled(False)
            self.run_dir = None

    # ------------------------------------------------------------------ the main thread's hot path

    def phase(self, now: float, slot: int) -> None:
        n = self._n
        i = n & _MASK
        self._t[i] = now
        self._c[i] = slot
        self._n = n + 1
        if self._kind_of[slot] != self.spans.current:
            self._activity_changes(now, slot)

    def wait(self, now: float, op: str) -> None:
        code = self._ops.get(op)
        if code is None:
            code = self._intern(op)
        n = self._n
        i = n & _MASK
        self._t[i] = now
        self._c[i] = code
        self._n = n + 1

    def end_wait(self, now: float) -> None:
        n = self._n
        i = n & _MASK
        self._t[i] = now
        self._c[i] = WAIT_END
        self._n = n + 1

    def step(self, now: float, step: int) -> None:
        """Step `step` begins now (the one before it ended)."""
        n = self._n
        i = n & _MASK
        self._t[i] = now
        self._c[i] = STEP_CODE - step
        self._n = n + 1
        nb = self._nb
        self._at[nb & _BOUNDS_MASK] = n
        self._nb = nb + 1
        self._step = step
        self._last_t = now
        if nb + 1 >= self._due or now >= self._due_time:
            self._service(now)

    # ------------------------------------------------------------------ marks (any thread)

    def mark(self, name: str, *, kind: str, **args: Any) -> None:
        """An instant event now: a fault, a membership change, a replacement, a straggler, a checkpoint, a
        restart, an evaluation. Safe from any thread; notable kinds keep the steps around them in the part."""
        if not self.opened:
            return
        self._inbox.append((perf_counter(), name, kind, self._step, self._nb, self._n, args))
        if kind in WINDOW_KINDS:
            self._due = 0  # the main thread looks at the next step boundary

    # ------------------------------------------------------------------ the main thread, now and then

    def _intern(self, op: str) -> int:
        if len(self._op_names) >= MAX_OPS:
            return MAX_PHASES + MAX_OPS - 1
        code = self._ops[op] = MAX_PHASES + len(self._op_names)
        self._op_names.append(op)
        return code

    def _activity_changes(self, now: float, slot: int) -> None:
        if self._kind_of[slot] < 0 and self._clock is not None:
            names = self._clock.names
            self._kind_of[slot] = self.spans.activity_of(names[slot] if slot < len(names) else "")
        self.spans.switch(now, self._kind_of[slot])

    def _service(self, now: float) -> None:
        """At a step boundary: take the marks, copy out the windows that closed, write when due."""
        self._due = _NEVER
        if self._first_t < 0:
            self._first_t = now
        urgent = self._take_marks()
        self._close_windows()
        if urgent or now >= self._due_time:
            try:
                self.flush()
            except OSError as exc:  # a full disk must not stop the training: the next write may succeed
                self.write_error = f"{type(exc).__name__}: {exc}"
        self._due = min((w[1] + 1 for w in self._open), default=_NEVER)
        if self._inbox:  # a mark came meanwhile (another thread)
            self._due = 0

    def _take_marks(self) -> bool:
        urgent = False
        while self._inbox:
            t, name, kind, step, nb, n, args = self._inbox.popleft()
            self.marks.add({"t": self._us(t), "name": name, "kind": kind, "step": step, "args": args})
            urgent = urgent or kind in URGENT_KINDS
            if kind in WINDOW_KINDS:
                self._open_window(nb, n)
        return urgent

    def _open_window(self, nb: int, n: int) -> None:
        """Steps WINDOW before the one under way at the mark (its boundary is nb - 1) to WINDOW after it;
        a window that overlaps the last open one extends it."""
        start, end = nb - 1 - self.window, nb - 1 + self.window + 1
        if self._open and start <= self._open[-1][1]:
            self._open[-1][1] = max(self._open[-1][1], end)
        else:
            self._open.append([start, end, n])

    def _close_windows(self) -> None:
        while self._open and self._open[0][1] < self._nb:
            start, end, mark_n = self._open.pop(0)
            lo, hi = max(self._position(start), self._copied_to), self._position(end)
            if hi - lo > MAX_CHUNK:  # centred on the mark
                lo = max(lo, min(mark_n - MAX_CHUNK // 2, hi - MAX_CHUNK))
                hi = lo + MAX_CHUNK
            if hi > lo:
                self._windows.append((lo, hi, json.dumps(self._chunk(lo, hi, self._t[hi & _MASK]))))
                self._copied_to = hi
                if len(self._windows) > MAX_WINDOWS:
                    del self._windows[FIRST_WINDOWS]
                    self.dropped_windows += 1

    def _position(self, boundary: int) -> int:
        """The ring index of a step boundary, or of the oldest record the ring still holds."""
        oldest = max(self._n - RING, 0)
        if boundary < 0 or boundary < self._nb - BOUNDS:
            return oldest
        return max(oldest, self._at[boundary & _BOUNDS_MASK])

    def _chunk(self, lo: int, hi: int, end: float) -> dict[str, Any]:
        """Records lo..hi-1 as a chunk, led by the phase that was under way at lo."""
        records: list[int] = []
        slot = self._phase_at(lo)
        if slot is not None:
            records += (self._us(self._t[lo & _MASK]), slot)
        t, c = self._t, self._c
        for i in range(lo, hi):
            records += (self._us(t[i & _MASK]), c[i & _MASK])
        return {"start": self._us(t[lo & _MASK]), "end": self._us(end), "records": records}

    def _phase_at(self, index: int) -> int | None:
        for i in range(index, max(self._n - RING, 0) - 1, -1):
            code = self._c[i & _MASK]
            if 0 <= code < MAX_PHASES:
                return code
        return None

    def _us(self, t: float) -> int:
        return round((t - self.perf_origin) * 1e6)

    def wall(self, t: float) -> float:
        return self.origin_wall + (t - self.perf_origin)

    # ------------------------------------------------------------------ writing

    def flush(self) -> Path | None:
        """Write this process's part now (main thread). Atomic: a reader sees the old part or the new one."""
        if self.run_dir is None:
            return None
        now = perf_counter()
        self._due_time = now + FLUSH_S
        self._take_marks()
        path = self.run_dir / "trace" / f"{self.key}.json"
        path.parent.mkdir(exist_ok=True)  # not parents: a run directory that is gone stays gone
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(self._part_text(now))
        os.replace(tmp, path)
        return path

    def _part_text(self, now: float) -> str:
        chunks = [text for _, _, text in self._windows]
        chunks += [json.dumps(self._chunk(lo, hi, end)) for lo, hi, end in self._recent(now)]
        head = {
            "format": FORMAT,
            "track": self.track,
            "key": self.key,
            "pid_hint": os.getpid(),
            "origin_wall": self.origin_wall,
            "written_wall": self.wall(now),
            "first_step_wall": self.wall(self._first_t) if self._first_t >= 0 else None,
            "last_step": self._step,
            "last_step_wall": self.wall(self._last_t) if self._last_t >= 0 else None,
            "phases": list(self._clock.names) if self._clock is not None else [],
            "ops": list(self._op_names),
            "marks": self.marks.kept,
            "spans": self.spans.as_list(self._us, now),
            "dropped": {"windows": self.dropped_windows, "marks": self.marks.dropped},
        }
        body = json.dumps(head, default=str)
        return body[:-1] + ', "chunks": [' + ", ".join(chunks) + "]}"

    def _recent(self, now: float) -> list[tuple[int, int, float]]:
        """The last `recent` steps' records that no window holds: (first, past the last, end time)."""
        cursor, hi = max(self._position(self._nb - self.recent), self._n - MAX_RECENT), self._n
        pieces = []
        for lo, past, _ in self._windows:
            if past > cursor:
                if lo > cursor:
                    pieces.append((cursor, lo, self._t[lo & _MASK]))
                cursor = past
        if hi > cursor:
            pieces.append((cursor, hi, now))
        return pieces

    def _flush_at_exit(self) -> None:
        try:
            if self.opened:
                self.flush()
        except Exception:  # noqa: BLE001 - best effort at exit: never raise there
            pass


TIMELINE = Timeline()
