"""lockstep's own data-parallel engine: replicas kept identical by averaging gradients during backward.

Public: `DistributedDataParallel` (drop-in for torch's class) and `replicate` (native, in place) with the
`ReplicaHandle` it returns, `SyncPolicy` (the engine's frozen settings), `EngineStats`/`StepStats` (what
`stats()` returns) and `GradBucket` (what a communication hook receives). Behind them (docs/engine.md
has the map): the faces (ddp, replicate, joinable, wrap_checks), the per-model state and its mode
(state, mode), the bucketed reducer and its phases (reducer, phase, bucket_launch, bucket_plan,
bucket_layout, bucket_memory, fast_hooks, step, unused, shadow, stats), the optimizer overlapped with
communication (optimizer_steps, overlapped_optimizer, shard_overlap), accumulate() and deterministic
mode (micro_step, exact, exact_buckets, fixed_point, small_grads, running_stats), wrap-time sync
(init_sync), uneven inputs (join), sharded optimizer state (shard_optimizer: `ShardedOptimizer`, what
`ReplicaHandle.shard_optimizer()` returns), the settings (policy) and the old class path for pickles (api);
compression and powersgd (comm hooks) are public in lockstep.hooks, syncbn in lockstep.nn.
"""

from __future__ import annotations

from lockstep.engine.bucket_memory import GradBucket
from lockstep.engine.ddp import DistributedDataParallel
from lockstep.engine.policy import SyncPolicy
from lockstep.engine.replicate import ReplicaHandle, replicate
from lockstep.engine.shard_optimizer import ShardedOptimizer
from lockstep.engine.stats import EngineStats, StepStats

__all__ = [
    "DistributedDataParallel",
    "EngineStats",
    "GradBucket",
    "ReplicaHandle",
    "ShardedOptimizer",
    "StepStats",
    "SyncPolicy",
    "replicate",
]
