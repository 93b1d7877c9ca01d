"""`lockstep run -n N --min-world M`: live mode, where a rank's death does not stop the others.

torch's elastic agent cannot do this: when one worker fails it stops every worker of the node and
restarts them all (elastic/agent/server/api.py). So in live mode `lockstep run` starts the workers itself,
with subprocess, and hosts the c10d store (TCPStore) that they form their groups on
(runtime/live.py): the store must outlive any worker, and the launcher is the one process that does. It is
the smallest supervisor that live mode needs, and nothing else: workers still run under
`lockstep.launch.worker`, log to the same rank directories, and are relayed to the console and swept at
the end as under the agent.

- A worker that exits non-zero or is killed while others run is a fault: the launcher writes
  `LIVE_DEAD_KEY<rank>` = how it ended to the store at once (survivors that were not its neighbours learn
  it there), prints one line, and the others go on.
- Fewer than M workers left running, and the rest not finished: the job fails, the launcher stops the
  others (SIGTERM, then SIGKILL after the grace) and prints the failure summary.
- Every worker done: exit 0 when the ones that finished all exited 0 (faults survived are listed), else
  the first failure's code.
- Ctrl-C / SIGTERM: every worker's process group gets the signal, then SIGKILL after the grace.

Single node only for now (`--nnodes 1`), and no replacements (`--max-restarts 0`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

from lockstep.launch.agent_config import make_run_dir, omp_threads, worker_env
from lockstep.launch.console_relay import Console, ConsoleRelay
from lockstep.launch.failure_report import RankFailure, first_failure, format_failure
from lockstep.launch.process_sweep import kill_leftovers
from lockstep.launch.spec import LaunchSpec, check_entrypoint
from lockstep.launch.worker import ERROR_FILE_VAR, PID_FILE

POLL_S = 0.02  # how often the launcher looks at its workers: a death reaches the store this fast


@dataclass
class _Worker:
    rank: int
    rank_dir: str
    proc: subprocess.Popen[bytes]
    files: tuple[IO[bytes], IO[bytes]]
    ended_at: float | None = None

    def how(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


def launch_live(spec: LaunchSpec, *, cwd: str | None = None, console: Console | None = None) -> int:
    """Run `spec` in live mode on this node; return the exit code (see the module doc)."""
    import torch.distributed as dist  # after the cheap checks: a bad input fails at once

    from lockstep.runtime import env_contract as ev

    cwd = cwd or os.getcwd()
    check_entrypoint(spec, cwd)
    console = console or Console(sys.stdout, sys.stderr)
    run_dir = make_run_dir(spec.run_dir, cwd)
    threads, threads_note = omp_threads(spec)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # loopback: one node
    relay = ConsoleRelay(console, logs=spec.logs)
    n = spec.nproc_per_node
    base_env = {**os.environ, **worker_env(spec, threads, None)}
    console.line(
        "stderr",
        f"lockstep run: {n} processes x 1 node (world {n}), live mode (--min-world {spec.min_world}: "
        f"survivors go on when a rank dies), store 127.0.0.1:{store.port}, {threads_note}, logs in {run_dir}",
    )
    workers: list[_Worker] = []
    relay.start()
    interrupted: list[int] = []
    saved = {
        sig: signal.signal(sig, lambda s, _f: interrupted.append(s))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        for rank in range(n):
            env = {
                **base_env,
                ev.RANK_VAR: str(rank),
                ev.LOCAL_RANK_VAR: str(rank),
                ev.WORLD_SIZE_VAR: str(n),
                ev.LOCAL_WORLD_SIZE_VAR: str(n),
                ev.GROUP_RANK_VAR: "0",
                ev.MASTER_ADDR_VAR: "127.0.0.1",
                ev.MASTER_PORT_VAR: str(store.port),
                ev.LIVE_MIN_WORLD_VAR: str(spec.min_world),
                ev.REPORT_DIR_VAR: run_dir,
            }
            workers.append(_start(spec, rank, run_dir, env, cwd))
            relay.follow(rank, *(os.path.join(workers[-1].rank_dir, f) for f in ("stdout.log", "stderr.log")))
        code, report = _supervise(
            spec, workers, store, console, interrupted, ev.LIVE_DEAD_KEY, ev.LIVE_CHANGES_KEY
        )
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)
        _stop(workers, spec.shutdown_grace)
        kill_leftovers([w.rank_dir for w in workers])
        relay.stop()
        for w in workers:
            for fh in w.files:
                fh.close()
    if report:
        console.line("stderr", report)
    return code


def _start(spec: LaunchSpec, rank: int, run_dir: str, env: dict[str, str], cwd: str) -> _Worker:
    rank_dir = os.path.join(run_dir, f"rank{rank}")
    os.makedirs(rank_dir, exist_ok=True)
    for name in ("stdout.log", "stderr.log", "error.json", PID_FILE):
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
    return _Worker(rank, rank_dir, proc, (out, err))


def _supervise(
    spec: LaunchSpec,
    workers: list[_Worker],
    store: Any,
    console: Console,
    interrupted: list[int],
    dead_key: str,
    changes_key: str,
) -> tuple[int, str]:
    faults: list[_Worker] = []
    while True:
        if interrupted:
            sig = interrupted[0]
            _signal_all(workers, sig)
            return (
                128 + sig,
                f"lockstep run: interrupted by {signal.Signals(sig).name}; every worker was stopped",
            )
        for w in workers:
            if w.ended_at is None and w.proc.poll() is not None:
                w.ended_at = time.time()
                running = [x for x in workers if x.ended_at is None]
                in_job = len(running) + sum(
                    1 for x in workers if x.ended_at is not None and x.proc.returncode == 0
                )
                if w.proc.returncode != 0 and running:
                    store.add(changes_key, 1)  # first: see runtime/live.py, which reads the two in this order
                    store.set(f"{dead_key}{w.rank}", w.how())
                    faults.append(w)
                    console.line(
                        "stderr",
                        f"lockstep run: rank {w.rank} {w.how()}; {len(running)} of {len(workers)} ranks "
                        + ("go on" if in_job >= (spec.min_world or 1) else "left")
                        + f" (--min-world {spec.min_world})",
                    )
        running = [w for w in workers if w.ended_at is None]
        if not running:
            return _outcome(workers, faults)
        in_job = len(running) + sum(1 for w in workers if w.ended_at is not None and w.proc.returncode == 0)
        if in_job < (spec.min_world or 1) and faults:
            failures = [_failure(w) for w in faults]
            return _code(first_failure(failures)), (
                f"lockstep run: FAILED: {in_job} of {len(workers)} ranks left, fewer than --min-world "
                f"{spec.min_world}\n" + format_failure(failures, len(workers))
            )
        time.sleep(POLL_S)


def _outcome(workers: list[_Worker], faults: list[_Worker]) -> tuple[int, str]:
    finished = [w for w in workers if w not in faults]
    failed = [w for w in finished if w.proc.returncode != 0]
    if failed or not finished:
        failures = [_failure(w) for w in (failed or faults)]
        return _code(first_failure(failures)), format_failure(failures, len(workers))
    if not faults:
        return 0, ""
    lost = ", ".join(f"rank {w.rank} ({w.how()})" for w in faults)
    return (
        0,
        f"lockstep run: finished on {len(finished)} of {len(workers)} ranks, without a restart; lost {lost}",
    )


def _code(failure: RankFailure) -> int:
    status = failure.exit_status
    return status if status > 0 else 128 - status


def _failure(w: _Worker) -> RankFailure:
    import json

    data: dict[str, Any] = {}
    try:
        with open(os.path.join(w.rank_dir, "error.json")) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        pass
    return RankFailure(w.rank, w.rank, w.proc.pid, int(w.proc.returncode or 0), data, w.rank_dir)


def _signal_all(workers: list[_Worker], sig: int) -> None:
    for w in workers:
        if w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _stop(workers: list[_Worker], grace: float) -> None:
    """SIGTERM what still runs, SIGKILL it after `grace` seconds."""
    if not any(w.proc.poll() is None for w in workers):
        return
    _signal_all(workers, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(POLL_S)
    _signal_all(workers, signal.SIGKILL)
    for w in workers:
        try:
            w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
