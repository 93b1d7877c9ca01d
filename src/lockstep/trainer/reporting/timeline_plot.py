"""run_dir/timeline.png: the run's timeline at a glance, drawn from the parts of runtime/timeline/.

Top: the whole run, one row per process, coloured by activity (training, checkpoint, evaluate, recovery,
...), faults, membership changes, replacements and restarts as vertical lines. Bottom: a zoom on the steps
around the first fault (the last ZOOM_STEPS steps when there was none), coloured by phase, collective waits
hatched on top. x is seconds since the run's first step in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lockstep.runtime.timeline.trace import GLOBAL_KINDS, decode, read_parts

ZOOM_STEPS = 30  # steps shown when no fault happened
AROUND_FAULT = 5  # steps shown on each side of the first fault
MAX_LABELS = 12
ACTIVITY_COLOURS = {
    "training": "#4c9a5b",
    "startup": "#bbbbbb",
    "checkpoint": "#e6c229",  # yellow: apart from the blues of forward and backward
    "evaluate": "#9b59b6",
    "recovery": "#d9534f",
    "state transfer": "#f0ad4e",
    "joining": "#5bc0de",
}
PHASE_COLOURS = {
    "data loading": "#8c6d31",
    "forward": "#6baed6",
    "backward": "#2171b5",
    "between steps": "#cccccc",
    "optimizer": "#74c476",
    **{k: v for k, v in ACTIVITY_COLOURS.items() if k != "training"},
}
MARK_COLOURS = {"fault": "#c0392b", "membership": "#2c3e50", "replacement": "#16a085", "restart": "#000000"}
_USER_COLOURS = ("#e377c2", "#bcbd22", "#17becf", "#ff7f0e", "#7f7f7f")


def draw_timeline(run_dir: Path | str) -> Path | None:
    """Write run_dir/timeline.png; None without parts or without matplotlib."""
    run_dir = Path(run_dir)
    parts = read_parts(run_dir)
    if not parts:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t0 = min(p["first_step_wall"] or p["origin_wall"] for p in parts)
    # taller with many processes (each replacement is one), the whole run's panel more so
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, max(6.0, 2.5 + 0.35 * len(parts))), height_ratios=[max(1, len(parts) / 4), 1]
    )
    _whole_run(top, parts, t0)
    _zoom(bottom, parts, t0)
    fig.subplots_adjust(left=0.21, right=0.83, top=0.93, bottom=0.08, hspace=0.45)  # tight_layout: 0.3 s more
    path = run_dir / "timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _shift(part: dict[str, Any], t0: float) -> float:
    """Seconds to add to a part-relative time (us / 1e6) for seconds since the run's first step."""
    return float(part["origin_wall"]) - t0


def _marks(parts: list[dict[str, Any]], t0: float) -> list[tuple[float, int, dict[str, Any]]]:
    """The run-wide marks (faults, membership changes, ...) in time order as (seconds, row, mark); the same
    event marked by several processes within a second is drawn once."""
    found = sorted(
        (mark["t"] / 1e6 + _shift(part, t0), row, mark)
        for row, part in enumerate(parts)
        for mark in part.get("marks", [])
        if mark["kind"] in GLOBAL_KINDS
    )  # fmt: skip
    out: list[tuple[float, int, dict[str, Any]]] = []
    for t, row, mark in found:
        if not any(
            m["kind"] == mark["kind"] and m["name"] == mark["name"] and t - s < 1.0 for s, _, m in out
        ):
            out.append((t, row, mark))
    return out


def _short(name: str) -> str:
    """A mark's name for the list beside the picture: 'lost members [1] (killed by SIGKILL)' ->
    'lost [1] (killed by SIGKILL)', cut at 30 characters."""
    name = name.replace("lost members ", "lost ").replace("replacements ", "")
    return name if len(name) <= 30 else name[:29] + "\u2026"


def _rows(axis: Any, parts: list[dict[str, Any]]) -> None:
    axis.set_yticks(range(len(parts)))
    axis.set_yticklabels([p["track"] for p in parts], fontsize=8)
    axis.set_ylim(len(parts) - 0.5, -0.5)


def _bars(axis: Any, row: int, pieces: dict[str, list[tuple[float, float]]], colours: dict[str, str]) -> None:
    for name, spans in pieces.items():
        axis.broken_barh(spans, (row - 0.4, 0.8), facecolors=colours.get(name, "#999999"), linewidth=0)


def _whole_run(axis: Any, parts: list[dict[str, Any]], t0: float) -> None:
    seen: set[str] = set()
    for row, part in enumerate(parts):
        shift = _shift(part, t0)
        pieces: dict[str, list[tuple[float, float]]] = {}
        for start, end, kind in part.get("spans", []):
            pieces.setdefault(kind, []).append((start / 1e6 + shift, (end - start) / 1e6))
        _bars(axis, row, pieces, ACTIVITY_COLOURS)
        seen |= set(pieces)
    _rows(axis, parts)
    marks = _marks(parts, t0)
    listed = []
    for k, (t, _, mark) in enumerate(marks):
        colour = MARK_COLOURS[mark["kind"]]
        axis.axvline(t, color=colour, linewidth=1, linestyle="--")
        if k < MAX_LABELS:  # a number on top of its line; what it was, in the list beside the legend
            axis.annotate(
                str(k + 1), (t, 1.0), xytext=(0, 2 + 7 * (k % 2)), textcoords="offset points", ha="center",
                xycoords=("data", "axes fraction"), fontsize=7, color=colour,
            )  # fmt: skip
            listed.append(f"{k + 1} {_short(mark['name'])}")
    if len(marks) > MAX_LABELS:
        listed.append(f"... {len(marks) - MAX_LABELS} more in trace.json")
    handles = [_patch(ACTIVITY_COLOURS[k], k) for k in ACTIVITY_COLOURS if k in seen]
    axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    if listed:
        axis.text(1.01, 0.0, "\n".join(listed), transform=axis.transAxes, fontsize=6, va="bottom")
    axis.set_title("whole run: activity per process", fontsize=9, pad=14)  # room for the marks' numbers
    axis.set_xlabel("seconds since the first step", fontsize=8)


def _zoom_range(
    parts: list[dict[str, Any]], sliced: list[dict[str, Any]], t0: float
) -> tuple[float, float, str]:
    """The seconds shown in the zoom: the steps around the first fault, or the last ZOOM_STEPS steps."""
    faults = [(row, m) for _, row, m in _marks(parts, t0) if m["kind"] == "fault"]
    steps = [
        (row, s[2], s[0] / 1e6 + _shift(part, t0), s[1] / 1e6 + _shift(part, t0))
        for row, (part, cut) in enumerate(zip(parts, sliced))
        for s in cut["steps"]
    ]
    if not steps:
        return 0.0, 1.0, "no steps recorded"
    if faults:  # the steps of the process that marked it (another may number them apart)
        row, mark = faults[0]
        step = mark.get("step") or 0
        near = [s[1:] for s in steps if s[0] == row and abs(s[1] - step) <= AROUND_FAULT]
        if near:
            return (
                min(s[1] for s in near),
                max(s[2] for s in near),
                f"steps around the first fault (step {step})",
            )
    last = max(s[1] for s in steps)
    recent = [s for s in steps if s[1] > last - ZOOM_STEPS]
    return min(s[2] for s in recent), max(s[3] for s in recent), f"the last {ZOOM_STEPS} steps"


def _zoom(axis: Any, parts: list[dict[str, Any]], t0: float) -> None:
    sliced = [decode(part) for part in parts]
    lo, hi, what = _zoom_range(parts, sliced, t0)
    colours, user = dict(PHASE_COLOURS), iter(_USER_COLOURS * 4)
    drawn: set[str] = set()
    shown = []  # the processes with something in the zoom (a replacement that came later has nothing)
    for part, cut in zip(parts, sliced):
        shift = _shift(part, t0)
        pieces: dict[str, list[tuple[float, float]]] = {}
        for start, end, name in cut["phases"]:
            a, b = start / 1e6 + shift, end / 1e6 + shift
            if b > lo and a < hi:
                pieces.setdefault(name, []).append((a, b - a))
                if name not in colours:
                    colours[name] = next(user, "#999999")
        waits = [
            (s / 1e6 + shift, (e - s) / 1e6)
            for s, e, _ in cut["waits"]
            if lo < e / 1e6 + shift and s / 1e6 + shift < hi
        ]
        if pieces or waits:
            shown.append((part, pieces, waits))
    for row, (_, pieces, waits) in enumerate(shown):
        _bars(axis, row, pieces, colours)
        drawn |= set(pieces)
        axis.broken_barh(
            waits, (row - 0.25, 0.5), facecolors="none", edgecolor="#222222", hatch="////", linewidth=0.3
        )
    for t, _, mark in _marks(parts, t0):
        if lo <= t <= hi:
            axis.axvline(t, color=MARK_COLOURS[mark["kind"]], linewidth=1.2)
    _rows(axis, [part for part, _, _ in shown] or parts)
    axis.set_xlim(lo, hi)
    handles = [_patch(colours[n], n) for n in colours if n in drawn]
    handles.append(_patch("none", "collective wait", hatch="////"))
    axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    axis.set_title(f"zoom: {what}, by phase", fontsize=9)
    axis.set_xlabel("seconds since the first step", fontsize=8)


def _patch(colour: str, label: str, hatch: str | None = None) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=colour, edgecolor="#222222" if hatch else colour, hatch=hatch, label=label)
