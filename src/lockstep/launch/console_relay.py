"""Copy what the workers write to the launcher's console: rank 0 live, the other ranks' warnings and errors.

Every worker writes its stdout and stderr to files in the run directory (torch's agent redirects them,
launch/rank_logs.py); `ConsoleRelay` follows those files from one thread and copies to the console what a
user should see:

- `logs="rank0"`: rank 0's output byte for byte (progress bars included), and from the other ranks
  every stderr line plus stdout lines that look like warnings or errors, each prefixed `[rank N]`;
- `logs="all"`: every line of every rank, prefixed `[rank N]`.
"""

from __future__ import annotations

import codecs
import re
import threading
from dataclasses import dataclass, field
from typing import Any, TextIO

_NOTEWORTHY = re.compile(
    r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b|Traceback \(most recent call last\)|\w(Warning|Error|Exception):"
)
_RANK_PREFIX = re.compile(r"^\[rank ?\d+")
_FULL_RANK_PREFIX = re.compile(r"^\[rank ?\d+(/\d+)?\]:? ?")
_TRACEBACK_START = re.compile(r"^(\[rank ?\d+(/\d+)?\]:? ?)?Traceback \(most recent call last\):")


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
        console.line(
            "stderr" if self.stream == "stderr" or self.mode == "notable" else "stdout", prefix + line
        )

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
