"""`lockstep run -n N --min-world M`: live mode, where a rank's death does not stop the others.

torch's elastic agent cannot do this: when one worker fails it stops every worker of the node and
restarts them all (elastic/agent/server/api.py). So in live mode `lockstep run` starts the workers itself
(launch/live_workers.py) and hosts the c10d store (TCPStore) that they form their groups on
(runtime/membership/): the store must outlive any worker, and the launcher is the one process that does.
It is the smallest supervisor that live mode needs (launch/live_supervisor.py), and nothing else: workers
still run under `lockstep.launch.worker`, log to the same rank directories, and are relayed to the
console and swept at the end as under the agent.

- Every worker done: exit 0 when training finished (the account of launch/live_account.py: at least one
  worker trained to the end and none ended with a job-ending error; faults survived are listed), else
  the first failure's code.
- A job-ending error (a worker exited with a recorded exception: live_account.py) with --max-restarts
  left, on one node: every worker is stopped and the whole job starts again, all N workers on a fresh
  store (a new loopback port: no key of the failed attempt remains), in `<run_dir>/restart<k>/`, one
  restart counted against --max-restarts (which replacements draw on too). fit's `resume="auto"` goes
  on from the run's last checkpoint. On several nodes the error ends the job on every node instead.
- Ctrl-C / SIGTERM: every worker's process group gets the signal, then SIGKILL after the grace; none of
  them counts as a fault.

Several nodes (`--nnodes K --node-rank I --rdzv-endpoint HOST:PORT`, the same -n on every node): node 0's
launcher hosts the store on HOST:PORT, the others connect to it; member ids are node * N + local rank.
Each launcher supervises its own workers and beats on the store (launch/node_heartbeat.py); node 0's
keeps the store up until every other node is done or silent. A node that loses the store (its link or the
head node is gone) stops its workers after STORE_LOST_S and fails; the survivors have evicted its ranks
by then (their heartbeats stopped) and go on while at least M remain. The job's fate below M is the
workers' to decide there (WorldTooSmallError), not one launcher's.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from lockstep.launch.agent_config import collective_interface, make_run_dir, omp_threads, worker_env
from lockstep.launch.console_relay import Console, ConsoleRelay
from lockstep.launch.flag_values import parse_endpoint
from lockstep.launch.live_account import error_summary
from lockstep.launch.live_supervisor import LiveSupervisor, NodeLayout
from lockstep.launch.live_workers import LiveWorker, start_worker, stop_workers
from lockstep.launch.process_sweep import kill_leftovers
from lockstep.launch.spec import LaunchSpec, check_entrypoint
from lockstep.runtime.env import env_contract as ev

STORE_OP_S = (
    5.0  # a launcher's store calls give up after this (another node's launcher: the link may be gone)
)


def launch_live(spec: LaunchSpec, *, cwd: str | None = None, console: Console | None = None) -> int:
    """Run `spec` in live mode on this node; return the exit code (see the module doc)."""
    cwd = cwd or os.getcwd()
    check_entrypoint(spec, cwd)
    console = console or Console(sys.stdout, sys.stderr)
    run_dir = make_run_dir(spec.run_dir, cwd)
    threads, threads_note = omp_threads(spec)
    interface, interface_note = collective_interface(spec, os.environ)
    job = _LiveJob(
        spec, cwd, run_dir, console, ConsoleRelay(console, logs=spec.logs),
        {**os.environ, **worker_env(spec, threads, interface)},
        ", ".join(x for x in (threads_note, interface_note) if x),
    )  # fmt: skip
    job.relay.start()
    interrupted: list[int] = []
    saved = {
        sig: signal.signal(sig, lambda s, _f: interrupted.append(s))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        code, report = job.run(interrupted)
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)
        job.close()
    if report:
        console.line("stderr", report)
    return code


@dataclass
class _LiveJob:
    """One launch in live mode on this node: its attempts (one, plus a whole-job restart after each
    job-ending error while --max-restarts allows, on one node) and every worker they started."""

    spec: LaunchSpec
    cwd: str
    run_dir: str
    console: Console
    relay: ConsoleRelay
    base_env: dict[str, str]
    notes: str
    workers: list[LiveWorker] = field(default_factory=list)  # every attempt's: swept and closed at the end

    def run(self, interrupted: list[int]) -> tuple[int, str]:
        """Run attempts until one ends without a restart due; its exit code and last lines."""
        attempt, budget = 0, self.spec.max_restarts
        while True:
            code, report, supervisor = self._attempt(attempt, budget, interrupted)
            if interrupted or not supervisor.restart_due():
                if code != 0 and attempt > 0 and not interrupted:
                    report += (
                        f"\nlockstep run: the job failed after {attempt} restart{'s' if attempt > 1 else ''} "
                        f"of the whole job; --max-restarts {self.spec.max_restarts} is used up"
                    )
                return code, report
            attempt, budget = attempt + 1, supervisor.replacements.left - 1
            self.console.line("stderr", self._restart_line(attempt, budget, supervisor))

    def close(self) -> None:
        stop_workers(self.workers, self.spec.shutdown_grace)
        kill_leftovers([w.rank_dir for w in self.workers])
        self.relay.stop()
        for w in self.workers:
            for fh in w.files:
                fh.close()

    def _attempt(self, attempt: int, budget: int, interrupted: list[int]) -> tuple[int, str, LiveSupervisor]:
        """Start the N workers of this node on a fresh store (node 0 of one node: a new port each attempt)
        and supervise them until this attempt is over; every one of them is stopped when it returns."""
        spec = self.spec
        store, layout = _open_store(spec)
        if attempt == 0:
            self.console.line("stderr", _header(spec, layout, self.notes, self.run_dir))
        base = self.run_dir if attempt == 0 else os.path.join(self.run_dir, f"restart{attempt}")
        mine: list[LiveWorker] = []

        def start(member_id: int, rank: int, local_rank: int, joiner: bool) -> LiveWorker:
            ids = (member_id, rank, local_rank)
            env = {**self.base_env, **_worker_vars(spec, layout, ids, joiner, base), **_attempt_vars(attempt)}
            worker = start_worker(spec, ids, base, env, self.cwd, joiner)
            mine.append(worker)
            self.workers.append(worker)
            self.relay.follow(
                member_id, *(os.path.join(worker.rank_dir, f) for f in ("stdout.log", "stderr.log"))
            )
            return worker

        supervisor = LiveSupervisor(
            spec, layout, mine, store, self.console, start, budget=budget, restarts=attempt
        )
        for local in range(spec.nproc_per_node):
            member_id = layout.node * spec.nproc_per_node + local
            start(member_id, member_id, local, False)
        code, report = supervisor.run(interrupted)
        stop_workers(mine, spec.shutdown_grace)
        return code, report, supervisor

    def _restart_line(self, attempt: int, budget: int, supervisor: LiveSupervisor) -> str:
        first = supervisor.errors[0]
        logs = os.path.join(first.rank_dir, "stderr.log")
        return (
            f"lockstep run: {error_summary(first)} (traceback in {logs}), which ends the job: every worker "
            f"was stopped; restart {attempt} of the whole job, all {self.spec.nproc_per_node} ranks from the "
            f"last checkpoint ({budget} of --max-restarts {self.spec.max_restarts} left); logs in "
            f"{os.path.join(self.run_dir, f'restart{attempt}')}"
        )


def _header(spec: LaunchSpec, layout: NodeLayout, notes: str, run_dir: str) -> str:
    replacements = f", up to {spec.max_restarts} replacements" if spec.max_restarts else ""
    where = f"node {layout.node} of {layout.nodes}, " if layout.nodes > 1 else ""
    return (
        f"lockstep run: {spec.nproc_per_node} processes x {layout.nodes} node{'s' if layout.nodes > 1 else ''} "
        f"(world {layout.world}), live mode (--min-world {spec.min_world}: survivors go on when a rank "
        f"dies{replacements}), {where}store {layout.host}:{layout.port}, {notes}, logs in {run_dir}"
    )


def _attempt_vars(attempt: int) -> dict[str, str]:
    """The job's attempt, as torch's agent and `lockstep run` without live mode give it to a restart."""
    return {ev.ATTEMPT_VAR: str(attempt), ev.RESTART_COUNT_VAR: str(attempt)}


def _open_store(spec: LaunchSpec) -> tuple[Any, NodeLayout]:
    """Node 0 hosts the job's store (loopback for one node); the others connect to it."""
    import torch.distributed as dist  # after the cheap checks: a bad input fails at once

    node = spec.node_rank or 0
    if not spec.is_multi_node:
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        return store, NodeLayout(0, 1, spec.nproc_per_node, "127.0.0.1", store.port)
    host, port = parse_endpoint(spec.endpoint)
    layout = NodeLayout(node, spec.max_nodes, spec.nproc_per_node, host, port)
    if node == 0:
        store = dist.TCPStore(host, port, None, True, wait_for_workers=False)
    else:  # node 0 may start later: wait for its store as long as a rendezvous would
        store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=300))
        store.set_timeout(timedelta(seconds=STORE_OP_S))
    return store, layout


def _worker_vars(
    spec: LaunchSpec, layout: NodeLayout, ids: tuple[int, int, int], joiner: bool, run_dir: str
) -> dict[str, str]:
    """The environment of a worker with `ids` (member id, RANK, LOCAL_RANK)."""
    member_id, rank, local_rank = ids
    return {
        ev.RANK_VAR: str(rank),
        ev.LOCAL_RANK_VAR: str(local_rank),
        ev.WORLD_SIZE_VAR: str(layout.world),
        ev.LOCAL_WORLD_SIZE_VAR: str(layout.per_node),
        ev.GROUP_RANK_VAR: str(layout.node),
        ev.MASTER_ADDR_VAR: layout.host,
        ev.MASTER_PORT_VAR: str(layout.port),
        ev.LIVE_MIN_WORLD_VAR: str(spec.min_world),
        ev.MEMBER_ID_VAR: str(member_id),
        ev.LIVE_JOIN_VAR: "1" if joiner else "0",
        ev.REPORT_DIR_VAR: run_dir,
    }
