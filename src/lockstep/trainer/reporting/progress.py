"""The console progress display on global rank 0 only: a tqdm bar in a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def choose_mode(requested: str, stream: TextIO) -> str:
    """'bar' in a terminal, 'lines' in log files and under SLURM, unless the user asked for one."""
    if requested != "auto":
        return requested
    return "bar" if stream.isatty() else "lines"


class ProgressBar:
    """Shows the step count and logged metrics. Constructed on every rank; silent everywhere but rank 0."""

    def __init__(
        self, total_steps: int, *, enabled: bool, mode: str = "auto", stream: TextIO | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.requested = mode
        self.mode = choose_mode(mode, self.stream) if enabled else "none"
        self.total_steps = total_steps
        self.started = time.monotonic()
        self._bar: Any = None
        if self.mode == "bar":
            self._start_bar()

    def _start_bar(self) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=self.total_steps, file=self.stream, dynamic_ncols=True, unit="step")

    def take_over(self, step: int) -> None:
        """This process became rank 0 (live mode: the old one was lost): show progress from `step` on."""
        if self.mode != "none":
            return
        self.mode = choose_mode(self.requested, self.stream)
        self.started = time.monotonic()
        if self.mode == "bar":
            self._start_bar()
        self.advance(step)

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        """Show logged metrics: in the bar's postfix, or as one line."""
        text = " ".join(f"{name}={_fmt(value)}" for name, value in metrics.items())
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)
        elif self.mode == "lines":
            elapsed = time.monotonic() - self.started
            print(f"step {step}/{self.total_steps} [{elapsed:.1f}s] {text}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        elif self.mode != "none":
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"
