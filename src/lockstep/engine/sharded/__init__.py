"""Sharded data parallelism on torch's FSDP2 (FSDP, HSDP) with lockstep's guarantees.

`shard()` cuts a model with torch's `fully_shard` (handle), in units that never split tied parameters
(units); deterministic mode makes FSDP2's reduce-scatter an exact sum (exact_scatter); otherwise FSDP2's
own collectives run, numbered for the hang watchdog (comms).

Modules:
- comms.py: FSDP2's all-gather and reduce-scatter, issued as torch issues them but numbered for the hang
  watchdog.
- exact_scatter.py: Deterministic mode on sharded parameters: FSDP2's reduce-scatter made an exact fixed-point
  sum.
- group_sync.py: A periodic sync across sharded replica groups (ShardPolicy.sync): what it refuses, and the outer
  sync of one rank, on its local shards, with its group's buffers made one at each round's end.
- handle.py: `shard(module, policy)`: the model cut into shards with torch's FSDP2, with lockstep's
  guarantees on top.
- rebuild.py: A sharded model carried onto a new world: what live mode's surviving replica groups do after a
  re-formation (issue 46; docs/notes/live_sharded_groups.md).
- step_marks.py: Where a sharded model's training steps begin and end, for the hang watchdog and the straggler
  reports.
- sums.py: How a sharded model's gradients are summed, chosen once per handle: lockstep's exact sums or FSDP2's
  own.
- units.py: Which submodules of a model get a `fully_shard` of their own (an FSDP unit each); the rest go to
  the root's.
"""

from lockstep.engine.sharded.handle import (
    ShardHandle,
    ShardLayout,
    ShardPolicy,
    full_tensors,
    is_sharded,
    shard,
)
from lockstep.engine.sharded.units import choose_units

__all__ = ["ShardHandle", "ShardLayout", "ShardPolicy", "choose_units", "full_tensors", "is_sharded", "shard"]
