"""What the launcher shows on the console: rank 0 live, other ranks' warnings and errors, one failure summary.

Every worker writes its stdout and stderr to files in the run directory (torch's agent redirects them);
`ConsoleRelay` follows those files from one thread and copies to the console what a user should see:

- `logs="rank0"`: rank 0's output byte for byte (progress bars included), and from the other ranks
  every stderr line plus stdout lines that look like warnings or errors, each prefixed `[rank N]`;
- `logs="all"`: every line of every rank, prefixed `[rank N]`.

`format_failure` turns torch's per-rank failures into one block: the first failing rank, its exit code
or signal, its Python traceback, the tail of its log and the log's path.
"""

from __future__ import annotations

import codecs
import os
import re
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

_NOTEWORTHY = re.compile(
    r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b|Traceback \(most recent call last\)|\w(Warning|Error|Exception):"
)
_RANK_PREFIX = re.compile(r"^\[rank ?\d+")
_FULL_RANK_PREFIX = re.compile(r"^\[rank ?\d+(/\d+)?\]:? ?")
_TRACEBACK_START = re.compile(r"^(\[rank ?\d+(/\d+)?\]:? ?)?Traceback \(most recent call last\):")
_SHUTDOWN_SIGNALS = {signal.SIGTERM, signal.SIGKILL, signal.SIGINT}
TAIL_LINES = 15


class Console:
    """The launcher's two console streams, shared by the relay thread and the launcher behind one lock."""

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._at_line_start = {"stdout": True, "stderr": True}
        self._lock = threading.Lock()

    def write(self, stream: str, text: str) -> None:
        """Write raw text (may end mid-line, e.g. a progress bar)."""
        if not text:
            return
        with self._lock:
            out = self._streams[stream]
            out.write(text)
            out.flush()
            self._at_line_start[stream] = text.endswith("\n")

    def line(self, stream: str, text: str) -> None:
        """Write whole lines, starting on a fresh line even if the last raw write ended mid-line."""
        with self._lock:
            out = self._streams[stream]
            if not self._at_line_start[stream]:
                out.write("\n")
            out.write(text if text.endswith("\n") else text + "\n")
            out.flush()
            self._at_line_start[stream] = True


@dataclass
class _Follower:
    """Reads one log file incrementally and decides, line by line, what reaches the console."""

    path: str
    rank: int
    stream: str  # "stdout" or "stderr"
    mode: str  # "raw" (rank 0 under logs=rank0), "all" (every line, prefixed) or "notable"
    offset: int = 0
    pending: str = ""
    in_traceback: bool = False
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def poll(self, console: Console, final: bool) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return  # not created yet
        self.offset += len(data)
        text = self.decoder.decode(data, final=final)
        if self.mode == "raw":
            console.write(self.stream, text)
            return
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        if final and self.pending:
            lines.append(self.pending)
            self.pending = ""
        for line in lines:
            self._emit(console, line)

    def _emit(self, console: Console, line: str) -> None:
        line = line.rsplit("\r", 1)[-1].rstrip()  # a progress bar's carriage returns: keep its last state
        if not line:
            return
        if self.mode == "notable":
            if self.stream == "stdout" and not _NOTEWORTHY.search(line):
                return
            folded = self._fold_traceback(line)
            if folded is None:
                return
            line = folded
        prefix = "" if _RANK_PREFIX.match(line) else f"[rank {self.rank}] "
        console.line("stderr" if self.stream == "stderr" or self.mode == "notable" else "stdout", prefix + line)


    def _fold_traceback(self, line: str) -> str | None:
        """Other ranks' tracebacks: only the exception line reaches the console; the full traceback is in
        the log file and, for the first failing rank, in the failure summary."""
        if _TRACEBACK_START.match(line):
            self.in_traceback = True
            return None
        if not self.in_traceback:
            return line
        body = _FULL_RANK_PREFIX.sub("", line)
        if body.startswith(" ") or not body.strip():
            return None  # a frame or source line
        self.in_traceback = False
        return f"{line}  (traceback in {self.path})"


class ConsoleRelay:
    """Follows every rank's stdout/stderr log files and copies what matters to the console (see module doc)."""

    def __init__(self, console: Console, *, logs: str, interval: float = 0.05) -> None:
        self._console = console
        self._logs = logs
        self._interval = interval
        self._followers: list[_Follower] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lockstep-console-relay", daemon=True)

    def follow(self, rank: int, stdout_path: str, stderr_path: str) -> None:
        """Start relaying one rank's two log files (called for every rank of every attempt)."""
        mode = "all" if self._logs == "all" else ("raw" if rank == 0 else "notable")
        with self._lock:
            self._followers.append(_Follower(stdout_path, rank, "stdout", mode))
            self._followers.append(_Follower(stderr_path, rank, "stderr", mode))

    def start(self) -> ConsoleRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following after copying everything the (now finished) workers wrote."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._poll(final=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._poll(final=False)

    def _poll(self, final: bool) -> None:
        with self._lock:
            followers = list(self._followers)
        for follower in followers:
            follower.poll(self._console, final)


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


def format_failure(failures: list[RankFailure], world_size: int | None) -> str:
    """One block: first failing rank, how it ended, its traceback, its log tail and paths, the others."""
    first = first_failure(failures)
    world = f"/{world_size}" if world_size else ""
    bar = "=" * 78
    out = [bar, f"lockstep run: FAILED: rank {first.rank}{world} (local rank {first.local_rank}, pid {first.pid}) "
           f"{first.how()}"]
    tb = first.traceback
    if tb:
        out += ["", f"[rank {first.rank}] traceback:", tb.rstrip()]
    else:
        reason = f"it was killed by {first.signal_name}" if first.exitcode < 0 else "it exited without raising"
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
