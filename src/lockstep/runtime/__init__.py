"""Who am I and how do I talk to the others: topology, process group, small collectives, rank-aware logs."""

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
from lockstep.runtime.process_group import init, is_initialized, shutdown
from lockstep.runtime.topology import Topology, expand_hostlist, resolve_topology

__all__ = [
    "Topology",
    "resolve_topology",
    "expand_hostlist",
    "init",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "is_main",
    "barrier",
    "main_process_first",
    "all_reduce_mean",
    "all_reduce_sum",
    "broadcast_object",
    "all_gather_object",
    "get_logger",
]
