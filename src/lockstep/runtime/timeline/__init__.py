"""A per-rank timeline of a run: each process's phases, collective waits, steps and marked events, written
as a part per process and merged into one Chrome trace (Perfetto, chrome://tracing).

`TIMELINE.open(run_dir, track=..., key=...)` starts recording this process; `TIMELINE.mark(...)` notes an
event; `merge_trace(run_dir)` writes run_dir/trace.json; trainer/reporting/timeline_plot.py draws it.

Modules:
- activity.py: The timeline's whole-run records, bounded: coarse activity spans and the marks.
- recorder.py: This process's timeline: its main thread's phases, collective waits and steps, and the events
  marked on it.
- trace.py: The timeline's files: the record codes, reading the per-process parts, and the Chrome trace merged
  from them.
"""

from __future__ import annotations

from lockstep.runtime.timeline.recorder import TIMELINE, Timeline
from lockstep.runtime.timeline.trace import clear_old_parts, merge_trace, part_stamps, read_parts

__all__ = ["TIMELINE", "Timeline", "clear_old_parts", "merge_trace", "part_stamps", "read_parts"]
