"""The timeline's files: the record codes, reading the per-process parts, and the Chrome trace merged from them.

recorder.py records each process's main thread as (time, code) pairs and writes them, a few
chunks of consecutive records, to `run_dir/trace/<key>.json` (its part). A code says what happened at that
time (`decode` turns a part's chunks back into slices):

- 0 .. MAX_PHASES-1: the phase in that slot of the part's "phases" began;
- MAX_PHASES + i: a blocking collective wait on the part's "ops"[i] began; WAIT_END: it ended;
- STEP_CODE - s (s >= 0): step s began (the one before it ended).

`merge_trace` writes `run_dir/trace.json` in the Chrome trace-event format (Perfetto, chrome://tracing):
one process per part, threads "steps", "phases" (collective waits nested in them) and "activity" (the whole
run, coarse), marks as instant events. Times are microseconds from the earliest event of any part; that
origin's wall time is otherData.origin_wall.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from lockstep.runtime.phase_clock import MAX_PHASES

WAIT_END = -1
STEP_CODE = -2  # step s began: STEP_CODE - s
FORMAT = 1
GLOBAL_KINDS = frozenset({"fault", "membership", "replacement", "restart"})  # drawn across every track
STEPS_TID, PHASES_TID, ACTIVITY_TID = 1, 2, 3
_THREADS = {STEPS_TID: "steps", PHASES_TID: "phases", ACTIVITY_TID: "activity"}

Slice = tuple[int, int, Any]  # (start us, end us, step number / phase name / op name), part-relative


def read_parts(run_dir: Path | str) -> list[dict[str, Any]]:
    """Every readable part in run_dir/trace/, in key order: a restarted run reads its previous attempt's
    `last_step` and `first_step_wall` here."""
    return _read_parts(Path(run_dir))[0]


def clear_old_parts(run_dir: Path | str, keep: str, *, unchanged_since: dict[str, int] | None = None) -> None:
    """A fresh run in a run directory that held another: the other run's parts go (all but `keep`'s, this
    process's own; the other ranks write theirs again every few seconds and at their end).
    `unchanged_since` (a `part_stamps` taken as this run began): only the parts listed there and not
    written since (a file's time, not the clock's: a file's time lags time.time() by up to a tick, so a
    part this run wrote just after a clock reading could look older than it)."""
    for path in (Path(run_dir) / "trace").glob("*.json"):
        if path.stem == keep:
            continue
        if unchanged_since is None or unchanged_since.get(path.name) == _written_ns(path):
            path.unlink(missing_ok=True)


def part_stamps(run_dir: Path | str) -> dict[str, int]:
    """Each part now in run_dir/trace/ by file name, with the time it was last written (ns)."""
    return {path.name: _written_ns(path) for path in (Path(run_dir) / "trace").glob("*.json")}


def _written_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return -1  # gone meanwhile: nothing to clear


def _read_parts(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    parts, skipped = [], []
    for path in sorted((run_dir / "trace").glob("*.json"), key=lambda p: _natural(p.stem)):
        try:
            part = json.loads(path.read_text())
        except (OSError, ValueError) as exc:  # a part cut short by a crash, or unreadable
            skipped.append({"file": path.name, "why": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        if not isinstance(part, dict) or part.get("format") != FORMAT or "track" not in part:
            skipped.append({"file": path.name, "why": "not a timeline part"})
            continue
        parts.append(part)
    return parts, skipped


def _natural(text: str) -> list[Any]:
    """'attempt0-member10' after 'attempt0-member2'."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def decode(part: dict[str, Any]) -> dict[str, list[Slice]]:
    """A part's chunks as slices: "steps", "phases" and "waits" (each wait inside its phase's slice).
    Chunks that follow each other without a gap are read as one; a slice open at a chunk's end ends there."""
    phases, ops = part.get("phases", []), part.get("ops", [])
    out: dict[str, list[Slice]] = {"steps": [], "phases": [], "waits": []}
    state = _Reader(out, phases, ops)
    end = None
    for chunk in sorted(part.get("chunks", []), key=lambda c: c["start"]):
        if end is not None and chunk["start"] > end:
            state.close(end)
        state.read(chunk["records"], chunk["start"])
        end = chunk["end"]
    if end is not None:
        state.close(end)
    return out


class _Reader:
    """The slices open while reading records: the phase, the wait inside it, the step."""

    def __init__(self, out: dict[str, list[Slice]], phases: list[str], ops: list[str]) -> None:
        self.out, self.phases, self.ops = out, phases, ops
        self.phase: int | None = None
        self.wait: int | None = None
        self.step: int | None = None
        self.phase_t = self.wait_t = self.step_t = 0

    def read(self, records: list[int], start: int) -> None:
        for k in range(0, len(records) - 1, 2):
            t, code = records[k], records[k + 1]
            if 0 <= code < MAX_PHASES:
                if code != self.phase:
                    self._end_phase(t)
                    self.phase, self.phase_t = code, t
            elif code >= MAX_PHASES:
                self._end_wait(t)
                self.wait, self.wait_t = code - MAX_PHASES, t
            elif code == WAIT_END:
                self._end_wait(t)
            else:
                step = STEP_CODE - code
                if self.step is not None:
                    self.out["steps"].append((self.step_t, t, self.step))
                elif step > 1 and t > start:  # the step under way when the chunk began
                    self.out["steps"].append((start, t, step - 1))
                self.step, self.step_t = step, t

    def _end_wait(self, t: int) -> None:
        if self.wait is not None and self.phase is not None:
            op = self.ops[self.wait] if self.wait < len(self.ops) else "?"
            self.out["waits"].append((self.wait_t, t, op))
        self.wait = None

    def _end_phase(self, t: int) -> None:
        self._end_wait(t)  # a wait never outlasts its phase's slice
        if self.phase is not None:
            name = self.phases[self.phase] if self.phase < len(self.phases) else "?"
            self.out["phases"].append((self.phase_t, t, name))
        self.phase = None

    def close(self, t: int) -> None:
        self._end_phase(t)
        if self.step is not None:
            self.out["steps"].append((self.step_t, t, self.step))
        self.step = None


def merge_trace(run_dir: Path | str) -> Path | None:
    """Write run_dir/trace.json from every part in run_dir/trace/ (unreadable ones skipped and named in
    otherData.skipped); None when there is no readable part."""
    run_dir = Path(run_dir)
    parts, skipped = _read_parts(run_dir)
    if not parts:
        return None
    origin = min(_earliest_wall(p) for p in parts)
    events: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        events += _part_events(part, index + 1, origin)
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ph"] != "M", e.get("ts", 0), -e.get("dur", 0)))
    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "origin_wall": origin,
            "parts": [p.get("key") for p in parts],
            "skipped": skipped,
        },
    }
    path = run_dir / "trace.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(trace, separators=(",", ":")))
    tmp.replace(path)
    return path


def _earliest_wall(part: dict[str, Any]) -> float:
    """The wall time of the part's first recorded instant (its origin plus the earliest offset)."""
    starts = [c["start"] for c in part.get("chunks", [])] + [s[0] for s in part.get("spans", [])[:1]]
    starts += [m["t"] for m in part.get("marks", [])[:1]]
    return float(part["origin_wall"]) + min(starts, default=0) / 1e6


def _part_events(part: dict[str, Any], pid: int, origin: float) -> list[dict[str, Any]]:
    shift = (float(part["origin_wall"]) - origin) * 1e6  # part-relative us -> trace us

    def slice_event(tid: int, s: Slice, name: str, cat: str) -> dict[str, Any]:
        return {
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "ts": s[0] + shift,
            "dur": s[1] - s[0],
            "name": name,
            "cat": cat,
        }

    events = [_meta(pid, 0, "process_name", name=str(part["track"]))]
    events.append(_meta(pid, 0, "process_sort_index", sort_index=pid))
    for tid, name in _THREADS.items():
        events += [
            _meta(pid, tid, "thread_name", name=name),
            _meta(pid, tid, "thread_sort_index", sort_index=tid),
        ]
    sliced = decode(part)
    events += [slice_event(STEPS_TID, s, f"step {s[2]}", "step") for s in sliced["steps"]]
    events += [slice_event(PHASES_TID, s, s[2], "phase") for s in sliced["phases"]]
    events += [slice_event(PHASES_TID, s, f"wait: {s[2]}", "wait") for s in sliced["waits"]]
    events += [slice_event(ACTIVITY_TID, tuple(s), s[2], "activity") for s in part.get("spans", [])]
    for mark in part.get("marks", []):
        events.append(
            {
                "ph": "i",
                "s": "g" if mark["kind"] in GLOBAL_KINDS else "p",
                "pid": pid,
                "tid": STEPS_TID,
                "ts": mark["t"] + shift,
                "name": mark["name"],
                "cat": mark["kind"],
                "args": {"step": mark.get("step"), **mark.get("args", {})},
            }
        )
    return events


def _meta(pid: int, tid: int, what: str, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": what, "args": args}
