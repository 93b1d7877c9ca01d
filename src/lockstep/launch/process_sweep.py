"""Find this launch's worker processes by the pids they wrote, and kill whatever of them is left.

Each worker (launch/worker.py) writes its pid to PID_FILE in its rank directory and leads its own process
group, so the launcher can reach a worker, and everything it started (DataLoader workers included), even
when torch's agent was interrupted before it could stop them, and nothing outside the run.
"""

from __future__ import annotations

import os
import signal

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
