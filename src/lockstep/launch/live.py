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
- A worker that the survivors evicted (it stopped answering: SIGSTOP, a hard hang; they mark it dead on
  the store themselves) is killed, so that it cannot wake up into a group that went on without it.
- With `--max-restarts R`, each lost worker (while the job goes on, up to R in all) is replaced by a new
  process with the next launch rank (N, N+1, ...) and the lost one's RANK/LOCAL_RANK (its device). It
  queues on the store and the members admit it at a step boundary (runtime/live.py). One that the job
  ended before admitting is told so through LIVE_CLOSED_KEY and exits 0.
- Every worker done: exit 0 when the ones that finished all exited 0 (faults survived are listed), else
  the first failure's code.
- Ctrl-C / SIGTERM: every worker's process group gets the signal, then SIGKILL after the grace.

Single node only for now (`--nnodes 1`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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
    rank: int  # launch rank (the store's uid): 0..N-1, then N, N+1, ... for replacements
    slot: int  # the RANK/LOCAL_RANK it runs as: its own for the first N, the lost one's for a replacement
    rank_dir: str
    proc: subprocess.Popen[bytes]
    files: tuple[IO[bytes], IO[bytes]]
    joiner: bool = False
    ended_at: float | None = None
    evicted: str | None = None  # why the survivors marked it dead while it still ran

    def how(self) -> str:
        if self.evicted:
            return self.evicted
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


def launch_live(spec: LaunchSpec, *, cwd: str | None = None, console: Console | None = None) -> int:
    """Run `spec` in live mode on this node; return the exit code (see the module doc)."""
    import torch.distributed as dist  # after the cheap checks: a bad input fails at once

    cwd = cwd or os.getcwd()
    check_entrypoint(spec, cwd)
    console = console or Console(sys.stdout, sys.stderr)
    run_dir = make_run_dir(spec.run_dir, cwd)
    threads, threads_note = omp_threads(spec)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # loopback: one node
    relay = ConsoleRelay(console, logs=spec.logs)
    n = spec.nproc_per_node
    base_env = {**os.environ, **worker_env(spec, threads, None)}
    replacements = f", up to {spec.max_restarts} replacements" if spec.max_restarts else ""
    console.line(
        "stderr",
        f"lockstep run: {n} processes x 1 node (world {n}), live mode (--min-world {spec.min_world}: "
        f"survivors go on when a rank dies{replacements}), store 127.0.0.1:{store.port}, {threads_note}, "
        f"logs in {run_dir}",
    )
    workers: list[_Worker] = []

    def start(uid: int, slot: int, joiner: bool) -> _Worker:
        env = {**base_env, **_worker_vars(spec, n, uid, slot, joiner, store.port, run_dir)}
        worker = _start(spec, uid, slot, run_dir, env, cwd, joiner)
        workers.append(worker)
        relay.follow(uid, *(os.path.join(worker.rank_dir, f) for f in ("stdout.log", "stderr.log")))
        return worker

    relay.start()
    interrupted: list[int] = []
    saved = {
        sig: signal.signal(sig, lambda s, _f: interrupted.append(s))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        for rank in range(n):
            start(rank, rank, False)
        code, report = _Supervisor(spec, workers, store, console, start).run(interrupted)
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


def _worker_vars(
    spec: LaunchSpec, n: int, uid: int, slot: int, joiner: bool, port: int, run_dir: str
) -> dict[str, str]:
    from lockstep.runtime import env_contract as ev

    return {
        ev.RANK_VAR: str(slot),
        ev.LOCAL_RANK_VAR: str(slot),
        ev.WORLD_SIZE_VAR: str(n),
        ev.LOCAL_WORLD_SIZE_VAR: str(n),
        ev.GROUP_RANK_VAR: "0",
        ev.MASTER_ADDR_VAR: "127.0.0.1",
        ev.MASTER_PORT_VAR: str(port),
        ev.LIVE_MIN_WORLD_VAR: str(spec.min_world),
        ev.LIVE_UID_VAR: str(uid),
        ev.LIVE_JOIN_VAR: "1" if joiner else "0",
        ev.REPORT_DIR_VAR: run_dir,
    }


def _start(
    spec: LaunchSpec, uid: int, slot: int, run_dir: str, env: dict[str, str], cwd: str, joiner: bool
) -> _Worker:
    rank_dir = os.path.join(run_dir, f"rank{uid}")
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
    return _Worker(uid, slot, rank_dir, proc, (out, err), joiner=joiner)


class _Supervisor:
    """The launcher's loop in live mode: it watches the workers and writes what it sees to the store."""

    def __init__(
        self,
        spec: LaunchSpec,
        workers: list[_Worker],
        store: Any,
        console: Console,
        start: Callable[[int, int, bool], _Worker],
    ) -> None:
        from lockstep.runtime import env_contract as ev

        self.spec, self.workers, self.store, self.console, self.start = spec, workers, store, console, start
        self.keys = ev
        self.faults: list[_Worker] = []
        self.replacements_left = spec.max_restarts
        self.changes_seen = 0
        self.closed = False

    def run(self, interrupted: list[int]) -> tuple[int, str]:
        n = self.spec.nproc_per_node
        while True:
            if interrupted:
                sig = interrupted[0]
                _signal_all(self.workers, sig)
                return (
                    128 + sig,
                    f"lockstep run: interrupted by {signal.Signals(sig).name}; every worker was stopped",
                )
            self._kill_evicted()
            for w in list(self.workers):
                if w.ended_at is None and w.proc.poll() is not None:
                    self._ended(w)
            running = self._running()
            if not running:
                return _outcome(self.workers, self.faults)
            if self._in_job() < (self.spec.min_world or 1) and self.faults:
                failures = [_failure(w) for w in self.faults]
                return _code(first_failure(failures)), (
                    f"lockstep run: FAILED: {self._in_job()} of {n} ranks left, fewer than --min-world "
                    f"{self.spec.min_world}\n" + format_failure(failures, n)
                )
            self._close_if_only_queued(running)
            time.sleep(POLL_S)

    def _running(self) -> list[_Worker]:
        return [w for w in self.workers if w.ended_at is None]

    def _in_job(self) -> int:
        ended_ok = sum(1 for w in self.workers if w.ended_at is not None and w.proc.returncode == 0)
        return len(self._running()) + ended_ok

    def _marked_dead(self, w: _Worker) -> str | None:
        key = f"{self.keys.LIVE_DEAD_KEY}{w.rank}"
        return bytes(self.store.get(key)).decode() if self.store.check([key]) else None

    def _kill_evicted(self) -> None:
        """The survivors marked a running worker dead (it stopped answering): end it for good."""
        changes = int(self.store.add(self.keys.LIVE_CHANGES_KEY, 0))
        if changes == self.changes_seen:
            return
        self.changes_seen = changes
        for w in self._running():
            if w.evicted is None and (why := self._marked_dead(w)) is not None:
                w.evicted = why
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)  # SIGKILL ends a stopped process too
                except (ProcessLookupError, PermissionError):
                    pass

    def _ended(self, w: _Worker) -> None:
        w.ended_at = time.time()
        running = self._running()
        if w.proc.returncode == 0 or not running:
            return
        if w.evicted is None and (why := self._marked_dead(w)) is not None:
            w.evicted = why  # it marked itself dead (a replacement that could not heal)
        if w.evicted is None:
            self.store.add(self.keys.LIVE_CHANGES_KEY, 1)  # first: see runtime/live.py
            self.store.set(f"{self.keys.LIVE_DEAD_KEY}{w.rank}", w.how())
        self.faults.append(w)
        goes_on = self._in_job() >= (self.spec.min_world or 1)
        line = (
            f"lockstep run: rank {w.rank} {w.how()}; {len(running)} of {len(self.workers)} ranks "
            + ("go on" if goes_on else "left")
            + f" (--min-world {self.spec.min_world})"
        )
        if goes_on and self.replacements_left > 0:
            self.replacements_left -= 1
            uid = max(x.rank for x in self.workers) + 1
            self.start(uid, w.slot, True)
            line += (
                f"; replacement rank {uid} started, it joins at a step boundary "
                f"({self.replacements_left} replacements left)"
            )
        self.console.line("stderr", line)

    def _close_if_only_queued(self, running: list[_Worker]) -> None:
        """Only replacements that were never admitted still run: the job is over, tell them."""
        if self.closed or not all(w.joiner for w in running):
            return
        admitted = [w for w in running if self.store.check([f"{self.keys.LIVE_ADMIT_KEY}{w.rank}"])]
        if not admitted:
            self.store.set(self.keys.LIVE_CLOSED_KEY, "1")
            self.closed = True


def _outcome(workers: list[_Worker], faults: list[_Worker]) -> tuple[int, str]:
    finished = [w for w in workers if w not in faults]
    failed = [w for w in finished if w.proc.returncode != 0]
    if failed or not finished:
        failures = [_failure(w) for w in (failed or faults)]
        return _code(first_failure(failures)), format_failure(failures, len(workers))
    if not faults:
        return 0, ""
    lost = ", ".join(f"rank {w.rank} ({w.how()})" for w in faults)
    started = sum(1 for w in workers if not w.joiner)
    joined = [w.rank for w in finished if w.joiner]
    replaced = f" ({len(joined)} of them replacements: ranks {joined})" if joined else ""
    return (
        0,
        f"lockstep run: finished on {len(finished)} of {started} ranks{replaced}, without a restart; lost {lost}",
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
