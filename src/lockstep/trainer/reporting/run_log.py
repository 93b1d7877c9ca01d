"""The run's metric log on rank 0: JSONL and CSV always, TensorBoard when installed, a PNG plot at the end."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any

REACHED = ".step_reached"  # the last step that counted, in the run directory


class RunLog:
    """Append-only metric records, one per logged step or evaluation, written as they come."""

    def __init__(self, run_dir: Path, *, enabled: bool) -> None:
        self.enabled = False
        self.run_dir = run_dir
        self.records: list[dict[str, Any]] = []
        self._tb: Any = None
        self._reached_fd: int | None = None
        if enabled:
            self._enable()

    def _enable(self) -> None:
        self.enabled = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tb = _tensorboard_writer(self.run_dir / "tensorboard")

    def take_over(self, step: int) -> None:
        """This process became rank 0 (live mode: the old one was lost): log from now on, the history
        rewound to what the lost rank 0 wrote up to `step` (where the group stands)."""
        if not self.enabled:
            self._enable()
        self.rewind(step)

    @property
    def _jsonl(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def reached(self, step: int, samples_lost: int) -> None:
        """`step` counted, `samples_lost` so far (the run's account): kept in a file of their own, rewritten
        in place (a few microseconds; the kernel keeps it when the process is killed), so that a restart
        knows how far the crashed attempt came and what earlier restarts had lost already."""
        if not self.enabled:
            return
        if self._reached_fd is None:
            self._reached_fd = os.open(self.run_dir / REACHED, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._reached_fd, b"%12d %15d\n" % (step, samples_lost), 0)

    def last_step(self) -> tuple[int, int]:
        """(the last step an earlier attempt counted, the samples it had lost so far); (0, 0) when unknown.
        The step from the step file and the metric log, whichever is further."""
        if not self.enabled:
            return 0, 0
        logged = max((r.get("step", 0) for r in self._read()), default=0)
        try:
            counted, lost = (int(v) for v in (self.run_dir / REACHED).read_text().split())
        except (OSError, ValueError):
            counted, lost = 0, 0
        return max(logged, counted), lost

    def _read(self) -> list[dict[str, Any]]:
        """The records in metrics.jsonl, a line cut short by a crash left out."""
        records = []
        if self._jsonl.is_file():
            for line in self._jsonl.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if isinstance(record, dict):
                    records.append(record)
        return records

    def rewind(self, step: int) -> None:
        """Keep the history up to `step` (where the run resumes) and drop what a crashed attempt logged after it."""
        if not self.enabled:
            return
        kept = [record for record in self._read() if record.get("step", 0) <= step]
        self.records = kept
        self._jsonl.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def truncate(self, count: int) -> None:
        """Keep the first `count` records (live mode, a low-communication run going back to a round's start:
        what was logged since is logged again as the round is redone)."""
        if not self.enabled or len(self.records) == count:
            return
        self.records = self.records[:count]
        self._jsonl.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with open(self._jsonl, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(name, value, record["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        if self._reached_fd is not None:
            os.close(self._reached_fd)
            self._reached_fd = None
        self._write_csv()
        if self._tb is not None:
            self._tb.close()

    def _write_csv(self) -> None:
        columns: list[str] = []
        for record in self.records:
            columns.extend(key for key in record if key not in columns)
        with open(self.run_dir / "metrics.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.records)

    def plot(self, path: Path) -> Path | None:
        """Loss and metric curves against steps; None when matplotlib is not installed."""
        if not self.enabled or not self.records:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        names = sorted({k for r in self.records for k, v in r.items() if k != "step" and _is_plottable(v)})
        # One panel per quantity, train and eval curves together: loss, accuracy, then the learning rate.
        panels = [[n for n in names if n.endswith(kind)] for kind in ("loss", "accuracy")] + [
            ["lr"] if "lr" in names else []
        ]
        panels = [panel for panel in panels if panel]
        fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), squeeze=False, sharex=True)
        for axis, panel in zip(axes[:, 0], panels):
            for name in panel:
                points = [(r["step"], r[name]) for r in self.records if _is_plottable(r.get(name))]
                axis.plot(*zip(*points), marker="." if len(points) < 30 else None, label=name)
            axis.set_ylabel(panel[0].split("_")[-1])
            axis.legend(loc="best", fontsize="small")
            axis.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("optimizer step")
        fig.suptitle(self.run_dir.name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _is_plottable(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _tensorboard_writer(path: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(path))
