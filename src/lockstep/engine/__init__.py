"""lockstep's own data-parallel engine: replicas kept identical by averaging gradients during backward.

Public: `DistributedDataParallel` (drop-in for torch's class), `replicate` (native, in place) and the
`ReplicaHandle` it returns, `SyncPolicy` (the engine's frozen settings), `EngineStats`/`StepStats` (what
`stats()` returns) and `GradBucket` (what a communication hook receives). The modules behind them:
policy (settings), bucket_layout (pure bucket assignment), bucket_memory (flat buffers, GradBucket),
init_sync (cross-rank model check and broadcast), state (per-model state, hook registration), step (one
backward's bookkeeping), reducer (per-bucket launch/wait/scale), unused (unused-parameter agreement),
join (uneven inputs), stats (timings), api (the two entry points); compression and powersgd (comm hooks)
are public in lockstep.hooks, syncbn in lockstep.nn.
"""

from __future__ import annotations

from lockstep.engine.api import DistributedDataParallel, ReplicaHandle, replicate
from lockstep.engine.bucket_memory import GradBucket
from lockstep.engine.policy import SyncPolicy
from lockstep.engine.stats import EngineStats, StepStats

__all__ = [
    "DistributedDataParallel",
    "EngineStats",
    "GradBucket",
    "ReplicaHandle",
    "StepStats",
    "SyncPolicy",
    "replicate",
]
