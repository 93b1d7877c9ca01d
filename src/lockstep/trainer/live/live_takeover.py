"""Live mode inside fit: a new rank 0 takes over what the lost members did (their metric rows, the log),
and the progress line that tells of a change.

When members are lost, rank 0 of the new generation (the same process, or another one when the old rank 0
was lost) reads from the store the metric rows that the lost members committed since the last log
(runtime/membership/commit.py), so that the interval's logged means cover every sample, as in a run
without the fault. A process that became rank 0 also takes over the metric log and the progress bar.
"""

from __future__ import annotations

from lockstep.runtime.membership.group import LiveGroup
from lockstep.runtime.membership.records import Fault
from lockstep.trainer.reporting.metrics import OrderedMetrics, TrainMetrics
from lockstep.trainer.reporting.progress import ProgressBar
from lockstep.trainer.reporting.run_log import RunLog


def take_over_rows(group: LiveGroup, metrics: TrainMetrics, lost: list[int]) -> None:
    """Rank 0 holds from now on the metric rows that the `lost` members committed since the last log."""
    pending = metrics.pending
    if not lost or not isinstance(pending, OrderedMetrics):
        return
    names = metrics.names("train")
    for step, generation in metrics.unlogged:
        for member in lost:
            rows = group.committed_rows(generation, step, member)
            if rows is not None:
                pending.add_packed(rows, names)


def take_over_log(runlog: RunLog, bar: ProgressBar, step: int) -> None:
    """This process became rank 0 (the old one was lost): the metric log, rewound to what the lost rank 0
    wrote up to `step` (where the group stands), and the progress bar, from now on."""
    runlog.take_over(step)
    bar.take_over(step)


def describe_change(fault: Fault, step: int) -> str:
    """The progress line that says what changed and how the run goes on."""
    if fault.kind == "joined":
        text = f"replacements {fault.joined} joined"
    else:
        text = f"launch ranks {fault.lost} left ({'; '.join(fault.how.values())})"
    return (
        f"live: {text}; going on with {fault.world_size} ranks from step {step} "
        f"({fault.recover_s:.2f} s to re-form)"
    )
