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

Several nodes (`--nnodes K --node-rank I --rdzv-endpoint HOST:PORT`, the same -n on every node): node 0's
launcher hosts the store on HOST:PORT, the others connect to it; launch ranks are node * N + local rank.
Each launcher supervises its own workers as above and beats on the store; node 0's keeps the store up
until every other node is done or silent. A node that loses the store (its link or the head node is
gone) stops its workers after STORE_LOST_S and fails; the survivors have evicted its ranks by then
(their heartbeats stopped) and go on while at least M remain. The job's fate below M is the workers'
to decide there (WorldTooSmallError), not one launcher's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any

from lockstep.launch.agent_config import collective_interface, make_run_dir, omp_threads, worker_env
from lockstep.launch.console_relay import Console, ConsoleRelay
from lockstep.launch.failure_report import RankFailure, first_failure, format_failure
from lockstep.launch.flag_values import parse_endpoint
from lockstep.launch.process_sweep import kill_leftovers
from lockstep.launch.spec import LaunchSpec, check_entrypoint
from lockstep.launch.worker import ERROR_FILE_VAR, PID_FILE

POLL_S = 0.02  # how often the launcher looks at its workers: a death reaches the store this fast
STORE_OP_S = (
    5.0  # a launcher's store calls give up after this (another node's launcher: the link may be gone)
)
STORE_LOST_S = 10.0  # a node that could not reach the store this long stops its workers and leaves the job
NODE_SILENT_S = 15.0  # node 0 stops waiting for a node whose launcher has not beaten for this long
_NODE_KEY = "lockstep/live/node/"
_REPLACEMENTS_KEY = "lockstep/live/replacements"


@dataclass
class _Worker:
    rank: int  # launch rank (the store's uid): 0..W-1 (node * N + local), then W, W+1, ... for replacements
    slot: int  # the RANK it runs as: its own for the first W, the lost one's for a replacement
    local: int  # its LOCAL_RANK (its device): the lost one's for a replacement
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


@dataclass(frozen=True)
class _Layout:
    """Where this launcher stands in the job."""

    node: int
    nodes: int
    per_node: int
    host: str  # the store's address (node 0's)
    port: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


def launch_live(spec: LaunchSpec, *, cwd: str | None = None, console: Console | None = None) -> int:
    """Run `spec` in live mode on this node; return the exit code (see the module doc)."""
    cwd = cwd or os.getcwd()
    check_entrypoint(spec, cwd)
    console = console or Console(sys.stdout, sys.stderr)
    run_dir = make_run_dir(spec.run_dir, cwd)
    threads, threads_note = omp_threads(spec)
    store, layout = _open_store(spec)
    interface, interface_note = collective_interface(spec, os.environ)
    relay = ConsoleRelay(console, logs=spec.logs)
    n = spec.nproc_per_node
    base_env = {**os.environ, **worker_env(spec, threads, interface)}
    replacements = f", up to {spec.max_restarts} replacements" if spec.max_restarts else ""
    where = f"node {layout.node} of {layout.nodes}, " if layout.nodes > 1 else ""
    notes = ", ".join(x for x in (threads_note, interface_note) if x)
    console.line(
        "stderr",
        f"lockstep run: {n} processes x {layout.nodes} node{'s' if layout.nodes > 1 else ''} (world "
        f"{layout.world}), live mode (--min-world {spec.min_world}: survivors go on when a rank "
        f"dies{replacements}), {where}store {layout.host}:{layout.port}, {notes}, logs in {run_dir}",
    )
    workers: list[_Worker] = []

    def start(uid: int, slot: int, local: int, joiner: bool) -> _Worker:
        env = {**base_env, **_worker_vars(spec, layout, uid, slot, local, joiner, run_dir)}
        worker = _start(spec, uid, slot, local, run_dir, env, cwd, joiner)
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
        for local in range(n):
            rank = layout.node * n + local
            start(rank, rank, local, False)
        code, report = _Supervisor(spec, layout, workers, store, console, start).run(interrupted)
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


def _open_store(spec: LaunchSpec) -> tuple[Any, _Layout]:
    """Node 0 hosts the job's store (loopback for one node); the others connect to it."""
    import torch.distributed as dist  # after the cheap checks: a bad input fails at once

    node = spec.node_rank or 0
    if not spec.is_multi_node:
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        return store, _Layout(0, 1, spec.nproc_per_node, "127.0.0.1", store.port)
    host, port = parse_endpoint(spec.endpoint)
    layout = _Layout(node, spec.max_nodes, spec.nproc_per_node, host, port)
    if node == 0:
        store = dist.TCPStore(host, port, None, True, wait_for_workers=False)
    else:  # node 0 may start later: wait for its store as long as a rendezvous would
        store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=300))
        store.set_timeout(timedelta(seconds=STORE_OP_S))
    return store, layout


def _worker_vars(
    spec: LaunchSpec, layout: _Layout, uid: int, slot: int, local: int, joiner: bool, run_dir: str
) -> dict[str, str]:
    from lockstep.runtime import env_contract as ev

    return {
        ev.RANK_VAR: str(slot),
        ev.LOCAL_RANK_VAR: str(local),
        ev.WORLD_SIZE_VAR: str(layout.world),
        ev.LOCAL_WORLD_SIZE_VAR: str(layout.per_node),
        ev.GROUP_RANK_VAR: str(layout.node),
        ev.MASTER_ADDR_VAR: layout.host,
        ev.MASTER_PORT_VAR: str(layout.port),
        ev.LIVE_MIN_WORLD_VAR: str(spec.min_world),
        ev.LIVE_UID_VAR: str(uid),
        ev.LIVE_JOIN_VAR: "1" if joiner else "0",
        ev.REPORT_DIR_VAR: run_dir,
    }


def _start(
    spec: LaunchSpec,
    uid: int,
    slot: int,
    local: int,
    run_dir: str,
    env: dict[str, str],
    cwd: str,
    joiner: bool,
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
    return _Worker(uid, slot, local, rank_dir, proc, (out, err), joiner=joiner)


class _Supervisor:
    """The launcher's loop in live mode: it watches the workers and writes what it sees to the store."""

    def __init__(
        self,
        spec: LaunchSpec,
        layout: _Layout,
        workers: list[_Worker],
        store: Any,
        console: Console,
        start: Callable[[int, int, int, bool], _Worker],
    ) -> None:
        from lockstep.runtime import env_contract as ev

        self.spec, self.layout, self.workers, self.store = spec, layout, workers, store
        self.console, self.start = console, start
        self.keys = ev
        self.faults: list[_Worker] = []
        self.replacements_left = spec.max_restarts
        self.changes_seen = 0
        self.closed = False
        self.reached = time.monotonic()  # the last time the store answered
        self.store_error = ""
        self.beaten = 0.0

    def run(self, interrupted: list[int]) -> tuple[int, str]:
        """Watch until the job is over on this node. The looking happens in a thread: a store call to node
        0 over a link that went down blocks without end, and then this thread still decides."""
        outcome: list[tuple[int, str]] = []
        looker = threading.Thread(target=self._look, args=(outcome,), name="lockstep-live", daemon=True)
        looker.start()
        while looker.is_alive():
            if interrupted:
                sig = interrupted[0]
                _signal_all(self.workers, sig)
                return (
                    128 + sig,
                    f"lockstep run: interrupted by {signal.Signals(sig).name}; every worker was stopped",
                )
            lost_for = time.monotonic() - self.reached
            if lost_for > STORE_LOST_S:
                return self._store_lost(lost_for)
            looker.join(POLL_S)
        return outcome[0]

    def _look(self, outcome: list[tuple[int, str]]) -> None:
        while True:
            try:
                result = self._tick()
            except (RuntimeError, OSError) as exc:  # the store did not answer (DistStoreError is one)
                self.store_error = _first_line(exc)
                time.sleep(POLL_S)
                continue
            self.reached = time.monotonic()
            if result is not None:
                outcome.append(result)
                return
            time.sleep(POLL_S)

    def _tick(self) -> tuple[int, str] | None:
        """One look at the workers and the store; the launcher's outcome once it is over."""
        self._kill_evicted()
        for w in list(self.workers):
            if w.ended_at is None and w.proc.poll() is not None:
                self._ended(w)
        self._beat()
        running = self._running()
        if not running:
            self._mark_node("done")
            if self.layout.node == 0 and not self._other_nodes_over():
                return None  # the store must outlive every node's workers
            code, report = _outcome(self.workers, self.faults)
            remote = self._lost_elsewhere() if self.layout.nodes > 1 and code == 0 else ""
            if remote:
                line = (
                    f"lockstep run: node {self.layout.node}'s ranks finished; lost on other nodes: {remote}"
                )
                report = f"{report}\n{line}" if report else line
            return code, report
        if self.layout.nodes == 1 and self._in_job() < (self.spec.min_world or 1) and self.faults:
            failures = [_failure(w) for w in self.faults]
            n = self.spec.nproc_per_node
            return _code(first_failure(failures)), (
                f"lockstep run: FAILED: {self._in_job()} of {n} ranks left, fewer than --min-world "
                f"{self.spec.min_world}\n" + format_failure(failures, n)
            )
        self._close_if_only_queued(running)
        return None

    def _store_lost(self, lost_for: float) -> tuple[int, str]:
        _signal_all(self.workers, signal.SIGKILL)
        why = f" ({self.store_error})" if self.store_error else ""
        return 1, (
            f"lockstep run: node {self.layout.node} lost the job's store at {self.layout.host}:"
            f"{self.layout.port} for {lost_for:.0f} s{why}: its link or node 0 is gone. This node's workers "
            f"were stopped; the other nodes go on while at least --min-world {self.spec.min_world} ranks remain"
        )

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
        if w.proc.returncode == 0 or (not running and self.layout.nodes == 1):
            return
        if w.evicted is None and (why := self._marked_dead(w)) is not None:
            w.evicted = why  # it marked itself dead (a replacement that could not heal)
        if w.evicted is None:
            self.store.add(self.keys.LIVE_CHANGES_KEY, 1)  # first: see runtime/live.py
            self.store.set(f"{self.keys.LIVE_DEAD_KEY}{w.rank}", w.how())
        self.faults.append(w)
        goes_on = self.layout.nodes > 1 or self._in_job() >= (self.spec.min_world or 1)
        here = len(self.workers) if self.layout.nodes == 1 else f"{len(self.workers)} on this node"
        line = (
            f"lockstep run: rank {w.rank} {w.how()}; {len(running)} of {here} ranks "
            + ("go on" if goes_on else "left")
            + f" (--min-world {self.spec.min_world})"
        )
        if goes_on and self.replacements_left > 0:
            self.replacements_left -= 1
            uid = self.layout.world + int(self.store.add(_REPLACEMENTS_KEY, 1)) - 1  # unique on every node
            self.start(uid, w.slot, w.local, True)
            line += (
                f"; replacement rank {uid} started, it joins at a step boundary "
                f"({self.replacements_left} replacements left)"
            )
        self.console.line("stderr", line)

    def _lost_elsewhere(self) -> str:
        """The ranks of other nodes marked dead on the store, with how, for the last line."""
        mine = {w.rank for w in self.workers}
        launched = self.layout.world + int(self.store.add(_REPLACEMENTS_KEY, 0))
        lost = []
        for uid in range(launched):
            key = f"{self.keys.LIVE_DEAD_KEY}{uid}"
            if uid not in mine and self.store.check([key]):
                lost.append(f"rank {uid} ({bytes(self.store.get(key)).decode()})")
        return ", ".join(lost)

    def _beat(self) -> None:
        now = time.monotonic()
        if self.layout.nodes > 1 and now - self.beaten > 0.5:
            self.store.set(f"{_NODE_KEY}{self.layout.node}/beat", str(time.time()))
            self.beaten = now

    def _mark_node(self, what: str) -> None:
        if self.layout.nodes > 1:
            self.store.set(f"{_NODE_KEY}{self.layout.node}/{what}", "1")

    def _node_state(self, node: int, what: str) -> bool:
        return bool(self.store.check([f"{_NODE_KEY}{node}/{what}"]))

    def _node_silent(self, node: int) -> bool:
        key = f"{_NODE_KEY}{node}/beat"
        if not self.store.check([key]):
            return False  # not started yet: node 0 waits for it as a rendezvous would
        return time.time() - float(bytes(self.store.get(key)).decode()) > NODE_SILENT_S

    def _other_nodes_over(self) -> bool:
        return all(
            self._node_state(node, "done") or self._node_silent(node)
            for node in range(self.layout.nodes)
            if node != self.layout.node
        )

    def _close_if_only_queued(self, running: list[_Worker]) -> None:
        """Only replacements that were never admitted still run, on every node: the job is over, tell them."""
        if self.closed:
            return
        idle = all(w.joiner for w in running) and not any(
            self.store.check([f"{self.keys.LIVE_ADMIT_KEY}{w.rank}"]) for w in running
        )
        if self.layout.nodes > 1:
            if idle:
                self._mark_node("idle")
            idle = idle and all(
                self._node_state(node, "idle") or self._node_state(node, "done") or self._node_silent(node)
                for node in range(self.layout.nodes)
            )
        if idle:
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
