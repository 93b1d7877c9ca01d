"""Sharded data parallelism on torch's FSDP2 (FSDP, HSDP) with lockstep's guarantees: handle.py."""

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
