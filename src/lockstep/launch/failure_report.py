"""The one block a failed launch ends with: the first failing rank, how it ended, its traceback and log tail.

`format_failure` turns torch's per-rank failures (`RankFailure`, one per failed worker) into that block:
the root cause first (a crash by signal, then the earliest recorded exception; ranks the launcher stopped
afterwards come last), its exit code or signal, its Python traceback, the tail of its log and the log's
path, then one line for each other failed rank.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HANG_REPORT = "hang_report.json"  # what runtime/watchdog.py writes in the attempt's directory
_SHUTDOWN_SIGNALS = {signal.SIGTERM, signal.SIGKILL, signal.SIGINT}
TAIL_LINES = 15


@dataclass(frozen=True)
class RankFailure:
    """One failed worker as torch's agent reported it, plus where its logs are."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    error_data: Mapping[str, Any]
    log_dir: str | None

    @property
    def record(self) -> Mapping[str, Any] | None:
        """The JSON the worker bootstrap wrote on an exception, if it got that far."""
        message = self.error_data.get("message") if isinstance(self.error_data, Mapping) else None
        return message if isinstance(message, Mapping) else None

    @property
    def traceback(self) -> str | None:
        record = self.record
        return str(record.get("extraInfo", {}).get("py_callstack") or "") or None if record else None

    @property
    def call_site(self) -> str | None:
        """The program's call into lockstep that raised (the innermost frame outside lockstep), if the
        exception came from inside lockstep."""
        record = self.record
        site = record.get("extraInfo", {}).get("lockstep_call_site") if record else None
        return str(site) if site else None

    @property
    def signal_name(self) -> str | None:
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def exit_status(self) -> int:
        """The exit code this rank chose, or its (negative) exit code when it was killed. A worker that had
        recorded its exception and was stopped by the agent while still exiting (its atexit work racing
        its peers' failures) chose the code in its record."""
        chosen = self.record.get("extraInfo", {}).get("lockstep_exitcode") if self.record else None
        if self.exitcode < 0 and -self.exitcode in _SHUTDOWN_SIGNALS and isinstance(chosen, int):
            return chosen
        return self.exitcode

    def how(self) -> str:
        if self.exit_status != self.exitcode:
            return f"exited with code {self.exit_status} (stopped by the launcher while exiting)"
        if self.exitcode < 0:
            return f"was killed by {self.signal_name} (exit code {self.exitcode})"
        return f"exited with code {self.exitcode}"

    def order(self) -> tuple[int, float, int]:
        """Sort key: root causes first. Ranks the agent stopped afterwards (SIGTERM/SIGKILL/SIGINT with no
        recorded exception, or an interrupted one) come last; a crash by signal (SIGSEGV, SIGABRT) is
        almost always the cause of its peers' errors, so it comes first."""
        record = self.record
        message = str(record.get("message", "")) if record else ""
        casualty = message.startswith("KeyboardInterrupt") or (
            record is None and self.exitcode < 0 and -self.exitcode in _SHUTDOWN_SIGNALS
        )
        if casualty:
            klass = 2
        elif record is None and self.exitcode < 0:
            klass = 0
        else:
            klass = 1
        when = record.get("extraInfo", {}).get("lockstep_time") if record else None
        return klass, float(when) if when is not None else float("inf"), self.rank


def first_failure(failures: list[RankFailure]) -> RankFailure:
    return min(failures, key=RankFailure.order)


def read_hang_report(attempt_dir: str | None) -> dict[str, Any] | None:
    """The report a worker's hang watchdog wrote in this attempt's directory (runtime/watchdog.py), if any."""
    if not attempt_dir:
        return None
    try:
        with open(os.path.join(attempt_dir, HANG_REPORT)) as fh:
            report = json.load(fh)
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def format_hang_failure(
    report: Mapping[str, Any], failures: list[RankFailure], world_size: int | None
) -> str:
    """The hang report, then how each rank ended: the watchdog ended the job, not an exception."""
    from lockstep.runtime.stall_verdict import format_report  # loads torch: only on this path

    world = f"/{world_size}" if world_size else ""
    culprits = ", ".join(str(r) for r in report.get("culprits") or []) or "none named"
    out = [
        format_report(report),
        f"lockstep run: FAILED: the hang watchdog ended the job (culprit rank(s): {culprits}; "
        f"report written by rank {report.get('detected_by')}{world})",
    ]
    out += [f"  rank {f.rank} {f.how()}" for f in sorted(failures, key=lambda f: f.rank)]
    return "\n".join(out)


def format_failure(failures: list[RankFailure], world_size: int | None) -> str:
    """One block: first failing rank, how it ended, its traceback, its log tail and paths, the others."""
    first = first_failure(failures)
    world = f"/{world_size}" if world_size else ""
    bar = "=" * 78
    out = [
        bar,
        f"lockstep run: FAILED: rank {first.rank}{world} (local rank {first.local_rank}, pid {first.pid}) "
        f"{first.how()}",
    ]
    tb = first.traceback
    if tb:
        out += ["", f"[rank {first.rank}] traceback:", tb.rstrip()]
        if first.call_site:
            out += ["", f"[rank {first.rank}] the failing call into lockstep: {first.call_site}"]
    else:
        reason = (
            f"it was killed by {first.signal_name}" if first.exitcode < 0 else "it exited without raising"
        )
        out += ["", f"[rank {first.rank}] no Python traceback was recorded ({reason}); its log tail follows"]
    out += _log_tail(first, tb)
    others = sorted((f for f in failures if f is not first), key=lambda f: f.rank)
    if others:
        out.append("")
        for other in others:
            record = other.record
            what = f": {record.get('message')}" if record else ""
            stopped = " (stopped by the launcher)" if other.order()[0] == 2 else ""
            out.append(f"also: rank {other.rank} {other.how()}{stopped}{what}")
    out.append(bar)
    return "\n".join(out)


def _log_tail(failure: RankFailure, traceback_text: str | None) -> list[str]:
    if not failure.log_dir:
        return []
    lines: list[str] = []
    paths = []
    for name in ("stderr.log", "stdout.log"):
        path = os.path.join(failure.log_dir, name)
        paths.append(path)
        text = _read_tail(path)
        if traceback_text and name == "stderr.log":
            # The traceback is already shown above: show what came before it.
            cut = text.rfind(traceback_text.strip().splitlines()[0])
            text = text[: text.rfind("\n", 0, cut) + 1] if cut >= 0 else text
        tail = [line.rsplit("\r", 1)[-1] for line in text.rstrip().splitlines()[-TAIL_LINES:]]
        tail = [line for line in tail if line.strip()]
        if tail:
            lines += ["", f"[rank {failure.rank}] last lines of {path}:", *(f"  {line}" for line in tail)]
    lines += ["", f"[rank {failure.rank}] logs: {paths[1]} and {paths[0]}"]
    return lines


def _read_tail(path: str, max_bytes: int = 16384) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
