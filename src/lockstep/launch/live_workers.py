"""Live mode's worker processes: started by the launcher itself, signalled, stopped, and read after they end.

In live mode `lockstep run` starts its workers with subprocess instead of torch's elastic agent (which
stops every worker of a node when one fails). Each still runs under `lockstep.launch.worker`, logs to its
rank directory (`rank<member id>/`) and is swept at the end like under the agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

from lockstep.launch.failure_report import RankFailure
from lockstep.launch.spec import LaunchSpec
from lockstep.launch.worker import ERROR_FILE_VAR, GOODPUT_FILE, PID_FILE

POLL_S = 0.02  # how often the launcher looks at its workers: a death reaches the store this fast


@dataclass
class LiveWorker:
    """One worker process of a live-mode launch."""

    member_id: int  # its id in the job: 0..W-1 (node * N + local), then W, W+1, ... for replacements
    rank: int  # the RANK it runs as: its member id for the first W, the lost one's for a replacement
    local_rank: int  # its LOCAL_RANK (its device): the lost one's for a replacement
    rank_dir: str
    proc: subprocess.Popen[bytes]
    files: tuple[IO[bytes], IO[bytes]]
    joiner: bool = False
    ended_at: float | None = None
    evicted: str | None = None  # why the survivors marked it dead while it still ran
    stopped: bool = False  # the launcher stopped it itself (an interrupt, the job's end, a restart)
    admitted: bool = False  # a replacement the members admitted (`admit/<member>` seen on the store)

    def how(self) -> str:
        if self.evicted:
            return self.evicted
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def raised(self) -> bool:
        """Its bootstrap recorded a Python exception (or a non-zero sys.exit) before it exited."""
        return self.failure().record is not None

    def failure(self) -> RankFailure:
        """How it failed, with the traceback its bootstrap recorded (launch/worker.py)."""
        data: dict[str, Any] = {}
        try:
            with open(os.path.join(self.rank_dir, "error.json")) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            pass
        code = int(self.proc.returncode or 0)
        return RankFailure(self.member_id, self.member_id, self.proc.pid, code, data, self.rank_dir)


def start_worker(
    spec: LaunchSpec,
    ids: tuple[int, int, int],
    run_dir: str,
    env: dict[str, str],
    cwd: str,
    joiner: bool,
) -> LiveWorker:
    """Start a worker; `ids`: its (member id, RANK, LOCAL_RANK)."""
    member_id, rank, local_rank = ids
    rank_dir = os.path.join(run_dir, f"rank{member_id}")
    os.makedirs(rank_dir, exist_ok=True)
    for name in ("stdout.log", "stderr.log", "error.json", PID_FILE, GOODPUT_FILE):
        try:
            os.remove(os.path.join(rank_dir, name))
        except FileNotFoundError:
            pass
    env[ERROR_FILE_VAR] = os.path.join(rank_dir, "error.json")
    kind = "module" if spec.module else "script"
    out = open(os.path.join(rank_dir, "stdout.log"), "wb")  # noqa: SIM115  closed by launch_live
    err = open(os.path.join(rank_dir, "stderr.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep.launch.worker", kind, spec.entrypoint, *spec.args],
        env=env,
        cwd=cwd,
        stdout=out,
        stderr=err,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: one killpg reaches its DataLoader workers
    )
    return LiveWorker(member_id, rank, local_rank, rank_dir, proc, (out, err), joiner=joiner)


def exit_code(failure: RankFailure) -> int:
    """The launcher's exit code for a failure: the worker's own, or 128 + the signal that killed it."""
    status = failure.exit_status
    return status if status > 0 else 128 - status


def signal_all(workers: list[LiveWorker], sig: int) -> None:
    """Send `sig` to every running worker's process group; each is marked as stopped by the launcher
    first, so that its end is never taken for a fault."""
    for w in workers:
        if w.proc.poll() is None:
            w.stopped = True
    for w in workers:
        if w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def stop_workers(workers: list[LiveWorker], grace: float) -> None:
    """SIGTERM what still runs, SIGKILL it after `grace` seconds."""
    if not any(w.proc.poll() is None for w in workers):
        return
    signal_all(workers, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(POLL_S)
    signal_all(workers, signal.SIGKILL)
    for w in workers:
        try:
            w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
