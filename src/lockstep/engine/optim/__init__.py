"""The optimizer wrappers: the optimizer stepped bucket by bucket in backward, and its state sharded (ZeRO-1).

`ShardedOptimizer` (shard_optimizer) is what `ReplicaHandle.shard_optimizer()` returns.

Modules:
- optimizer_steps.py: When the reducer steps the optimizer: never (plain), or each bucket as soon as its
  averages are back.
- overlapped_optimizer.py: The optimizer of an overlapped step: the user's optimizer, stepped bucket by bucket
  by the engine.
- shard_optimizer.py: Sharded optimizer state (ZeRO-1): each rank steps, and keeps the state of, its share of
  the parameters.
- shard_overlap.py: What an overlapped optimizer steps: whole parameters, or a share whose owners send each
  bucket in backward.
- shard_units.py: What a sharded optimizer hands out to the ranks: whole parameters, or pieces of them.
"""
