"""runtime/timeline/ (recorder.py, trace.py, activity.py), trainer/reporting/timeline_plot.py: a process's timeline
recorded through a Progress, bounded on long runs, merged into a Chrome trace and drawn."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lockstep.runtime.progress import CHECKPOINT, DATA, OPTIMIZER, CollectiveRecord, Progress
from lockstep.runtime.timeline import Timeline, recorder
from lockstep.runtime.timeline.activity import MAX_MARKS, MAX_SPANS, ActivitySpans, Marks
from lockstep.runtime.timeline.recorder import MAX_WINDOWS
from lockstep.runtime.timeline.trace import decode, merge_trace, read_parts
from lockstep.trainer.reporting.timeline_plot import draw_timeline

BUCKET = CollectiveRecord(1, "allreduce (gradient bucket)", "world", [], 0, "backward", "")


def _train(progress: Progress, steps: int, *, sleep: float = 0.0, waits: int = 2) -> None:
    """`steps` steps as the engine and a user loop mark them: data loading, forward, backward with `waits`
    collective waits, between steps, optimizer."""
    for _ in range(steps):
        progress.set_phase(DATA)
        progress.begin_step()
        progress.set_phase("backward")
        for _ in range(waits):
            progress.begin_wait(BUCKET)
            if sleep:
                time.sleep(sleep)
            progress.end_wait()
        progress.end_step()
        progress.set_phase(OPTIMIZER)


def _opened(run_dir: Path, key: str, track: str = "") -> tuple[Timeline, Progress]:
    progress, timeline = Progress(), Timeline()
    timeline.open(run_dir, track=track or key, key=key, clock=progress.clock)
    return timeline, progress


def _step_numbers(part: dict[str, Any]) -> set[int]:
    return {s[2] for s in decode(part)["steps"]}


def test_before_open_nothing_is_attached_and_marks_are_dropped(tmp_path: Path) -> None:
    progress, timeline = Progress(), Timeline()
    assert progress.clock.timeline is None  # the hot path's one attribute check
    timeline.mark("early", kind="fault")
    assert timeline.flush() is None and not (tmp_path / "trace").exists()
    timeline.open(tmp_path, track="rank 0", key="k", clock=progress.clock)
    assert progress.clock.timeline is timeline
    timeline.close()
    assert progress.clock.timeline is None
    assert json.loads((tmp_path / "trace" / "k.json").read_text())["marks"] == []


def test_a_100k_step_run_keeps_the_recent_steps_and_the_windows_around_marks(tmp_path: Path) -> None:
    """45 faults over 100k steps: 40 windows of 21 steps kept (the first 8 and the latest 32), the last 200
    steps, every mark; the ring overflowed ~30 times meanwhile and the part stays small."""
    timeline, progress = _opened(tmp_path, "attempt0-member0")
    fault_steps = []
    for k in range(45):
        _train(progress, 2000 if k else 1000)
        timeline.mark(f"rank 1 lost #{k}", kind="fault", rank=1)
        fault_steps.append(progress.step)
    _train(progress, 100_000 - progress.step)
    path = timeline.flush()
    assert path is not None and path.stat().st_size < 2_000_000
    part = json.loads(path.read_text())
    assert part["last_step"] == 100_000 and part["dropped"] == {"windows": 5, "marks": 0}
    assert [m["step"] for m in part["marks"]] == fault_steps and part["marks"][0]["args"] == {"rank": 1}
    steps = _step_numbers(part)
    kept = fault_steps[:8] + fault_steps[-32:]
    expected = {s + d for s in kept for d in range(-10, 11)} | set(range(99_801, 100_001))
    assert steps == expected and len(steps) == MAX_WINDOWS * 21 + 200
    assert not any(s in steps for s in fault_steps[8:13])  # the dropped windows
    sliced = decode(part)
    assert len(sliced["waits"]) == 2 * len(steps)  # every step's two waits, none lost at a chunk's edge
    assert {name for _, _, name in sliced["phases"]} == {
        DATA,
        "forward",
        "backward",
        "between steps",
        OPTIMIZER,
    }


def test_marks_from_another_thread_open_a_window_and_write_the_part_at_the_next_step(tmp_path: Path) -> None:
    timeline, progress = _opened(tmp_path, "k")
    _train(progress, 30)
    part_file = tmp_path / "trace" / "k.json"
    first = json.loads(part_file.read_text())  # written at the first step boundary
    assert first["last_step"] == 1 and first["first_step_wall"] is not None
    thread = threading.Thread(target=timeline.mark, args=("rank 1 too slow",), kwargs={"kind": "straggler"})
    thread.start()
    thread.join()
    timeline.mark("rank 2 lost", kind="membership", ranks=[0, 1])
    _train(progress, 1)
    part = json.loads(part_file.read_text())  # membership: written at the next step boundary
    assert part["last_step"] == 31 and [m["kind"] for m in part["marks"]] == ["straggler", "membership"]
    assert part["marks"][1]["args"] == {"ranks": [0, 1]} and part["marks"][1]["step"] == 30
    _train(progress, 300)
    part = json.loads(timeline.flush().read_text())  # type: ignore[union-attr]
    assert _step_numbers(part) == set(range(20, 41)) | set(range(132, 332))


def test_the_part_is_written_every_flush_interval_at_a_step_boundary(
    tmp_path: Path, monkeypatch: Any
) -> None:
    timeline, progress = _opened(tmp_path, "k")
    _train(progress, 5)
    part_file = tmp_path / "trace" / "k.json"
    assert json.loads(part_file.read_text())["last_step"] == 1
    monkeypatch.setattr(recorder, "FLUSH_S", 0.0)
    timeline.flush()
    _train(progress, 2)
    assert json.loads(part_file.read_text())["last_step"] == 7


def test_activity_spans_merge_training_phases_and_keep_the_others(tmp_path: Path) -> None:
    timeline, progress = _opened(tmp_path, "k")
    _train(progress, 3)
    progress.set_phase(CHECKPOINT)
    _train(progress, 3)
    progress.set_phase("my own phase")  # a user's phase is training
    progress.set_phase("evaluate")
    progress.set_phase("evaluate")
    part = json.loads(timeline.flush().read_text())  # type: ignore[union-attr]
    assert [s[2] for s in part["spans"]] == ["startup", "training", "checkpoint", "training", "evaluate"]
    assert all(a[1] == b[0] for a, b in zip(part["spans"], part["spans"][1:]))  # end to end
    assert all(s[0] <= s[1] for s in part["spans"])


def test_activity_spans_stay_bounded_on_a_run_that_changes_activity_often() -> None:
    spans = ActivitySpans()
    for k in range(3 * MAX_SPANS):
        spans.switch(float(k), k % 3)
    assert len(spans.starts) <= MAX_SPANS and len(spans.starts) == len(spans.kinds)
    assert spans.starts == sorted(spans.starts) and spans.starts[-1] == 3 * MAX_SPANS - 1
    assert all(a != b for a, b in zip(spans.kinds, spans.kinds[1:]))  # neighbours differ


def test_marks_keep_the_first_and_the_latest() -> None:
    marks = Marks()
    for k in range(MAX_MARKS + 500):
        marks.add({"n": k})
    kept = [m["n"] for m in marks.kept]
    assert len(kept) == MAX_MARKS and marks.dropped == 500
    assert kept[:1000] == list(range(1000)) and kept[1000:] == list(range(1500, MAX_MARKS + 500))


def _three_parts(run_dir: Path) -> None:
    """Three processes training the same steps, the second losing the third at step 25."""
    runs = [_opened(run_dir, f"attempt0-member{k}", f"rank {k} (member {k})") for k in range(3)]
    for step in range(40):
        for k, (timeline, progress) in enumerate(runs):
            if k == 2 and step >= 25:
                continue
            _train(progress, 1, sleep=0.0002)
            if step == 25 and k < 2:
                timeline.mark("rank 2 lost", kind="fault", rank=2)
                timeline.mark("saved", kind="checkpoint")
    for timeline, _ in runs:
        timeline.close()


def test_merge_of_three_parts_is_a_valid_chrome_trace_whose_slices_nest(tmp_path: Path) -> None:
    _three_parts(tmp_path)
    trace = json.loads(merge_trace(tmp_path).read_text())  # type: ignore[union-attr]
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["skipped"] == []
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {1: "rank 0 (member 0)", 2: "rank 1 (member 1)", 3: "rank 2 (member 2)"}
    slices = [e for e in events if e["ph"] == "X"]
    assert all({"ph", "ts", "dur", "pid", "tid", "name"} <= set(e) and e["dur"] >= 0 for e in slices)
    assert min(e["ts"] for e in slices) == 0  # relative to the earliest event
    for pid in (1, 2, 3):
        phases = sorted(
            (e["ts"], e["ts"] + e["dur"]) for e in slices if e["pid"] == pid and e["cat"] == "phase"
        )
        assert all(a[1] <= b[0] for a, b in zip(phases, phases[1:]))  # no overlap within the thread
        waits = [(e["ts"], e["ts"] + e["dur"]) for e in slices if e["pid"] == pid and e["cat"] == "wait"]
        assert waits and all(any(p[0] <= w[0] and w[1] <= p[1] for p in phases) for w in waits)
        steps = [e["name"] for e in slices if e["pid"] == pid and e["cat"] == "step"]
        assert steps == [f"step {s}" for s in range(1, 41 if pid < 3 else 26)]
    instants = [e for e in events if e["ph"] == "i"]
    assert sorted((e["pid"], e["name"], e["s"]) for e in instants) == [
        (1, "rank 2 lost", "g"), (1, "saved", "p"), (2, "rank 2 lost", "g"), (2, "saved", "p"),
    ]  # fmt: skip
    assert instants[0]["args"] == {"step": 26, "rank": 2} or instants[0]["args"]["step"] == 26


def test_a_corrupt_part_is_skipped_and_named(tmp_path: Path) -> None:
    _three_parts(tmp_path)
    (tmp_path / "trace" / "attempt0-member1.json").write_text('{"format": 1, "track": "rank 1", "chu')
    trace = json.loads(merge_trace(tmp_path).read_text())  # type: ignore[union-attr]
    assert [s["file"] for s in trace["otherData"]["skipped"]] == ["attempt0-member1.json"]
    assert trace["otherData"]["parts"] == ["attempt0-member0", "attempt0-member2"]
    assert len({e["pid"] for e in trace["traceEvents"]}) == 2


def test_read_parts_tells_a_restarted_run_where_the_last_attempt_got(tmp_path: Path) -> None:
    before = time.time()
    _three_parts(tmp_path)
    parts = read_parts(tmp_path)
    assert [p["key"] for p in parts] == [f"attempt0-member{k}" for k in range(3)]
    assert [p["last_step"] for p in parts] == [40, 40, 25]
    assert all(before <= p["first_step_wall"] <= p["last_step_wall"] <= time.time() for p in parts)
    assert merge_trace(tmp_path / "nothing here") is None and read_parts(tmp_path / "nothing here") == []


def test_open_again_starts_afresh(tmp_path: Path) -> None:
    timeline, progress = _opened(tmp_path, "first")
    _train(progress, 50)
    timeline.mark("lost", kind="fault")
    timeline.open(tmp_path, track="again", key="second", clock=progress.clock)
    _train(progress, 5)
    part = json.loads(timeline.flush().read_text())  # type: ignore[union-attr]
    assert part["marks"] == [] and _step_numbers(part) == set(range(50, 56))  # 50: under way at the open


def test_draw_timeline_writes_a_png_of_ten_by_six_inches(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    _three_parts(tmp_path)
    path = draw_timeline(tmp_path)
    assert path == tmp_path / "timeline.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(path).shape[:2] == (600, 1000)
    assert draw_timeline(tmp_path / "nothing here") is None


def test_recording_keeps_nothing_per_step_once_the_ring_is_full(tmp_path: Path) -> None:
    """50k steps (the ring wraps ~15 times) hold no more memory than the first 2k did: arrays written in
    place, nothing appended per step."""
    import tracemalloc

    timeline, progress = _opened(tmp_path, "k")
    _train(progress, 2000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _train(progress, 50_000)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000, f"{grown} bytes kept after 50k steps"
    assert timeline._n == 1 + 52_000 * 10  # the phase at the open, then 10 records a step (2 waits)


def test_a_write_that_fails_at_a_step_boundary_does_not_stop_the_training(tmp_path: Path) -> None:
    timeline, progress = _opened(tmp_path / "run", "k")
    (tmp_path / "run" / "trace" / "k.json").unlink(missing_ok=True)
    (tmp_path / "run" / "trace").rmdir()
    (tmp_path / "run" / "trace").write_text("a file where the folder was")
    _train(progress, 3)
    assert (
        progress.step == 3 and timeline.write_error is not None and "FileExistsError" in timeline.write_error
    )
