"""`lockstep run -n N --min-world M`: live mode, where a rank's death does not stop the others.

torch's elastic agent cannot do this: when one worker fails it stops every worker of the node and
restarts them all (elastic/agent/server/api.py). So in live mode `lockstep run` starts the workers itself
(launch/live_workers.py) and hosts the c10d store (TCPStore) that they form their groups on
(runtime/membership/): the store must outlive any worker, and the launcher is the one process that does.
It is the smallest supervisor that live mode needs (launch/live_supervisor.py), and nothing else: workers
still run under `lockstep.launch.worker`, log to the same rank directories, and are relayed to the
console and swept at the end as under the agent.

- Every worker done: exit 0 when the ones that finished all exited 0 (faults survived are listed), else
  the first failure's code.
- Ctrl-C / SIGTERM: every worker's process group gets the signal, then SIGKILL after the grace.

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
from datetime import timedelta
from typing import Any

from lockstep.launch.agent_config import collective_interface, make_run_dir, omp_threads, worker_env
from lockstep.launch.console_relay import Console, ConsoleRelay
from lockstep.launch.flag_values import parse_endpoint
from lockstep.launch.live_supervisor import LiveSupervisor, NodeLayout
from lockstep.launch.live_workers import LiveWorker, start_worker, stop_workers
from lockstep.launch.process_sweep import kill_leftovers
from lockstep.launch.spec import LaunchSpec, check_entrypoint
from lockstep.runtime import env_contract as ev

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
    workers: list[LiveWorker] = []

    def start(member_id: int, rank: int, local_rank: int, joiner: bool) -> LiveWorker:
        env = {**base_env, **_worker_vars(spec, layout, (member_id, rank, local_rank), joiner, run_dir)}
        worker = start_worker(spec, (member_id, rank, local_rank), run_dir, env, cwd, joiner)
        workers.append(worker)
        relay.follow(member_id, *(os.path.join(worker.rank_dir, f) for f in ("stdout.log", "stderr.log")))
        return worker

    relay.start()
    interrupted: list[int] = []
    saved = {
        sig: signal.signal(sig, lambda s, _f: interrupted.append(s))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        for local in range(n):
            member_id = layout.node * n + local
            start(member_id, member_id, local, False)
        code, report = LiveSupervisor(spec, layout, workers, store, console, start).run(interrupted)
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)
        stop_workers(workers, spec.shutdown_grace)
        kill_leftovers([w.rank_dir for w in workers])
        relay.stop()
        for w in workers:
            for fh in w.files:
                fh.close()
    if report:
        console.line("stderr", report)
    return code


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
