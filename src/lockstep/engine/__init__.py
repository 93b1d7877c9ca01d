"""lockstep's own data-parallel engine: replicas kept identical by averaging gradients during backward.

Public: `DistributedDataParallel` (drop-in for torch's class) and `replicate` (native, in place) with the
`ReplicaHandle` it returns, `shard` (the model cut in shards by torch's FSDP2: FSDP, HSDP) with its
`ShardPolicy` and `ShardHandle`, `SyncPolicy` (the engine's frozen settings), `EngineStats`/`StepStats` (what
`stats()` returns) and `GradBucket` (what a communication hook receives). The two faces
and the per-model core sit here; each engine behind them has a folder of its own (docs/engine.md draws
the whole). ddp.py and syncbn.py stay here because pickled models name their classes by module path.

Modules:
- api.py: Where models pickled before the engine's faces had modules of their own find the drop-in class.
- ddp.py: `DistributedDataParallel`: torch's drop-in class on lockstep's engine (torch's arguments,
  attributes, flags).
- replicate.py: `replicate`: lockstep's native face, a module made a replica in place, and the `ReplicaHandle`
  it returns.
- syncbn.py: SyncBatchNorm on any device and backend: batch statistics shared across ranks in forward and
  backward.
- buckets/: The bucketed reducer: the default engine, averaging gradients in buckets while backward runs.
- comm/: Communication hooks with torch's contract, public in `lockstep.hooks` under torch's names.
- core/: What every part of the engine shares, at the bottom of it: the settings (`SyncPolicy`, with the names
  it reads: the periodic sync algorithms and the wire formats of their deltas), the statistics, and the wrap-
  time agreement of every rank on the model.
- deterministic/: Deterministic mode and `accumulate()`: the same bits at any world size.
- dropin/: What the drop-in class (engine/ddp.py) owes torch's contract beyond training: checks, logging data,
  `model.reducer`, the Joinable protocol and torch.compile.
- optim/: The optimizer wrappers: the optimizer stepped bucket by bucket in backward, and its state sharded
  (ZeRO-1).
- periodic/: Periodic (low-communication) sync: replicas step on their own and meet every H steps (DiLoCo and
  kin).
- sharded/: Sharded data parallelism on torch's FSDP2 (FSDP, HSDP) with lockstep's guarantees: exact sums in
  FSDP2's reduce-scatter, named collectives, units that never split tied parameters.
- replica/: One replica's engine: its state (wrap-time sync, the buffer sync, torch's switches, join()) and
  its mode, chosen once from the policy: bucketed, exact (deterministic) or periodic.
"""

from __future__ import annotations

from lockstep.engine.buckets.bucket_memory import GradBucket
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.stats import EngineStats, StepStats
from lockstep.engine.ddp import DistributedDataParallel
from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.engine.replicate import ReplicaHandle, replicate
from lockstep.engine.sharded import ShardHandle, ShardPolicy, shard

__all__ = [
    "DistributedDataParallel",
    "EngineStats",
    "GradBucket",
    "ReplicaHandle",
    "ShardHandle",
    "ShardPolicy",
    "ShardedOptimizer",
    "StepStats",
    "SyncPolicy",
    "replicate",
    "shard",
]
