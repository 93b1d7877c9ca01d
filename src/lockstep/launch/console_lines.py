"""The launcher's own console lines: the header of a run, the line of each restart, the multi-node wait.

Each is a pure function of what the launch resolved and of the environment torch's agent gave the first
worker of an attempt (`env0`), so that their wording is decided in one place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

from lockstep.launch.spec import LaunchSpec


def attempt_line(
    spec: LaunchSpec,
    attempt: int,
    ranks: Mapping[int, str],
    env0: Mapping[str, str],
    threads_note: str,
    run_dir: str,
) -> str:
    """The line shown when the agent starts attempt `attempt`: the header for the first, else a restart line."""
    from lockstep.runtime.env.env_contract import RESTART_COUNT_VAR  # lockstep.runtime loads torch: only now

    if attempt == 0:
        return header(spec, env0, threads_note, run_dir)
    own_restarts = int(env0.get(RESTART_COUNT_VAR, attempt))
    return restart_line(attempt, own_restarts, spec.max_restarts, os.path.dirname(next(iter(ranks.values()))))


def restart_line(attempt: int, own_restarts: int, max_restarts: int, logs: str) -> str:
    """The line shown when the workers start again: the job's attempt and this node's restarts used. On a
    node restarted for a peer's failure (the rendezvous reopened) the two differ: it spent none of its own."""
    if own_restarts == attempt:
        return f"lockstep run: restart {attempt}/{max_restarts}; logs in {logs}"
    return (
        f"lockstep run: restart {attempt} of the job (another node's workers stopped; this node has used "
        f"{own_restarts}/{max_restarts} of its restarts); logs in {logs}"
    )


def header(spec: LaunchSpec, env0: Mapping[str, str], threads_note: str, run_dir: str) -> str:
    """The first line: what was resolved (processes x nodes, backend, endpoint, threads, logs)."""
    import torch

    from lockstep.runtime.env.env_contract import (
        GROUP_WORLD_SIZE_VAR,
        MASTER_ADDR_VAR,
        MASTER_PORT_VAR,
        WORLD_SIZE_VAR,
    )
    from lockstep.runtime.process_group import choose_backend

    backend = choose_backend("cuda" if torch.cuda.is_available() else "cpu")
    nnodes = int(env0.get(GROUP_WORLD_SIZE_VAR, spec.max_nodes))
    endpoint = f"{env0.get(MASTER_ADDR_VAR, '?')}:{env0.get(MASTER_PORT_VAR, '?')}"
    shown = "rank 0 here, other ranks' warnings/errors" if spec.logs == "rank0" else "all ranks here"
    return (
        f"lockstep run: {spec.nproc_per_node} process{'es' if spec.nproc_per_node != 1 else ''} x {nnodes} "
        f"node{'s' if nnodes != 1 else ''} (world {env0.get(WORLD_SIZE_VAR, '?')}), backend {backend}, "
        f"endpoint {endpoint}, {threads_note}, {ddp_note(spec)}, logs in {run_dir} ({shown})"
    )


def ddp_note(spec: LaunchSpec) -> str:
    """Which engine runs where the program asks for torch's DistributedDataParallel (--ddp)."""
    if spec.ddp == "lockstep":
        return "DDP engine lockstep (lockstep's class under torch's names)"
    return "DDP engine torch"


def waiting_line(spec: LaunchSpec, interface_note: str, run_dir: str) -> str:
    """Multi-node: shown before the rendezvous, which waits for the other nodes."""
    count = str(spec.max_nodes) if spec.min_nodes == spec.max_nodes else f"{spec.min_nodes}-{spec.max_nodes}"
    return (
        f"lockstep run: waiting for {count} nodes at {spec.endpoint} "
        f"(rendezvous {spec.rdzv_backend}, id {spec.rdzv_id or 'none'}"
        f"{', ' + interface_note if interface_note else ''}); logs in {run_dir}"
    )


def goodput_line(rank_dirs: Iterable[str]) -> str:
    """The last line of a job that finished: the run's goodput and time lost by cause, from the first of
    `rank_dirs` (rank 0's first) whose worker left its account (launch/worker.py); "" when none did."""
    from lockstep.launch.worker import GOODPUT_FILE
    from lockstep.runtime.run_account import describe  # lockstep.runtime loads torch: only now

    for rank_dir in rank_dirs:
        try:
            summary = json.loads(open(os.path.join(rank_dir, GOODPUT_FILE)).read())
        except (OSError, ValueError):
            continue
        return f"lockstep run: {describe(summary)}"
    return ""
