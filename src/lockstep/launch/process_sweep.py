"""Find this launch's worker processes by the pids they wrote, and kill whatever of them is left.

Each worker (launch/worker.py) writes its pid to PID_FILE in its rank directory and leads its own process
group, so the launcher can reach a worker, and everything it started (DataLoader workers included), even
when torch's agent was interrupted before it could stop them, and nothing outside the run.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from lockstep.launch.worker import PID_FILE


def worker_pids(rank_dirs: list[str]) -> list[int]:
    """The pids the workers wrote in their rank directories, for those that are still this launcher's
    children (a worker that exited may have left its pid to an unrelated process)."""
    pids = []
    for rank_dir in rank_dirs:
        pid = _read_pid(rank_dir)
        if pid is not None and _parent_of(pid) in (os.getpid(), None):
            pids.append(pid)
    return pids


def kill_leftovers(rank_dirs: list[str]) -> list[int]:
    """SIGKILL the process group of every worker of this launch (by the pid each wrote in its rank
    directory); return the groups that still had members. Each worker leads its own group, so this reaches
    its DataLoader workers and anything else it started, and nothing outside the run."""
    killed = []
    for rank_dir in rank_dirs:
        pid = _read_pid(rank_dir)
        if pid is None:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def _read_pid(rank_dir: str) -> int | None:
    try:
        with open(os.path.join(rank_dir, PID_FILE)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _parent_of(pid: int) -> int | None:
    """pid's parent pid from /proc (-1 when pid is gone), or None where there is no /proc to ask."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces: split after it
    except (OSError, ValueError, IndexError):
        return -1


def continue_stopped_on_term(rank_dirs: list[str]) -> list[int]:
    """SIGCONT every worker that is stopped (SIGSTOP, state T) with a SIGTERM pending; return their pids.

    torch's agent stops the workers of a failed job with SIGTERM and waits 30 s before SIGKILL whatever
    its shutdown timeout says. A stopped worker cannot act on SIGTERM until it continues, so without this
    a job with one SIGSTOPped rank (the case the hang watchdog reports) would take 30 s to end.
    """
    woken = []
    for pid in worker_pids(rank_dirs):
        if _stopped_with_term_pending(pid):
            try:
                os.kill(pid, signal.SIGCONT)
                woken.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return woken


def _stopped_with_term_pending(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
    except OSError:
        return False
    if not fields.get("State", "").strip().startswith(("T", "t")):
        return False
    term = 1 << (signal.SIGTERM - 1)
    return any(int(fields.get(name, "0").strip() or "0", 16) & term for name in ("SigPnd", "ShdPnd"))


class StoppedWorkerWaker:
    """A thread that applies continue_stopped_on_term to the current workers twice a second."""

    def __init__(self, rank_dirs: Callable[[], list[str]], interval: float = 0.5) -> None:
        self._rank_dirs, self._interval = rank_dirs, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-wake-stopped", daemon=True)

    def __enter__(self) -> StoppedWorkerWaker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            continue_stopped_on_term(self._rank_dirs())
