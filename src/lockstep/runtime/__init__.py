"""Who am I and how do I talk to the others: topology, process group, small collectives, rank-aware logs.

Modules: topology (pure: environment -> Topology, for torchrun, SLURM, explicit arguments or nothing),
slurm_notation (SLURM's host and task lists), env_contract (the environment variables launcher and runtime
share), process_group (init/shutdown; init returns a JoinedTopology, a Topology that `with` can own),
collectives (rank queries and small typed collectives), logging (rank-aware loggers), and the hang
watchdog: progress (what this process is doing: step, phase, numbered collectives), watchdog (the thread
that publishes it to the c10d store and judges a stall) and stall_verdict (the judgement and the report);
phase_clock and straggler_reports time each phase per step and name a rank persistently slower than the others
(`stragglers()` returns rank 0's reports). The launcher
imports this package: nothing here imports the engine.
"""

from __future__ import annotations

from lockstep.runtime.collectives import (
    all_gather_object,
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    is_main,
    main_process_first,
)
from lockstep.runtime.logging import get_logger
from lockstep.runtime.process_group import JoinedTopology, init, is_initialized, shutdown
from lockstep.runtime.progress import phase
from lockstep.runtime.slurm_notation import expand_hostlist
from lockstep.runtime.straggler_reports import StragglerReport, stragglers
from lockstep.runtime.topology import Topology, resolve_topology

__all__ = [
    "JoinedTopology",
    "StragglerReport",
    "Topology",
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "expand_hostlist",
    "get_logger",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "is_main",
    "main_process_first",
    "phase",
    "resolve_topology",
    "shutdown",
    "stragglers",
]
