"""A periodic sync across sharded replica groups (ShardPolicy.sync): what it refuses, and the outer sync of
one rank, on its local shards, with its group's buffers made one at each round's end."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from lockstep.engine.core.init_sync import broadcast_coalesced
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.periodic.outer_sync import OuterSync
from lockstep.errors import ConfigError, NotSupportedError


def check_periodic(policy: SyncPolicy | None, *, deterministic: bool, world: int, degree: int) -> None:
    """A periodic sync across the replica groups needs two groups or more, and not what it does not run."""
    sync = policy.sync if policy is not None else None
    if world // degree < 2:
        raise ConfigError(
            f"ShardPolicy(sync={sync!r}) with shard_degree {degree} at world {world}: one replica group has no "
            "other to meet; use a shard_degree that makes two groups or more (HSDP), or leave sync at allreduce"
        )
    if deterministic or (policy is not None and policy.deterministic):
        raise NotSupportedError(
            f"ShardPolicy(sync={sync!r}) in deterministic mode: its exact sums are not built for the inner steps "
            "of a sharded periodic sync (the groups' reduce-scatters are FSDP2's float sums); leave deterministic "
            "off (in ShardPolicy and SyncPolicy), or sync every step"
        )
    if policy is not None and policy.periodic_settings.warmup_steps:
        raise NotSupportedError(
            f"ShardPolicy(sync={sync!r}) with warmup_steps: a warm-up averages whole gradients before the rounds "
            "start, and a sharded run's outer sync holds its local shards alone (not built); leave warmup_steps "
            "at 0"
        )


class GroupSync:
    """One rank's periodic sync on a sharded model: engine/periodic/outer_sync.py's OuterSync on its local
    shards, over the ranks that hold the same shard in every replica group (`replicate_group`)."""

    def __init__(
        self,
        module: nn.Module,
        policy: SyncPolicy,
        shard_group: dist.ProcessGroup,
        replicate_group: dist.ProcessGroup | None,
        replicas: int,
    ) -> None:
        self.outer = OuterSync(module, policy, replicate_group, world=replicas)
        self.shard_group = shard_group
        self._buffer_means_shared = 0

    def after_optimizer_step(self) -> bool:
        synced = self.outer.after_optimizer_step()
        self._share_buffer_means()
        return synced

    def flush(self) -> bool:
        flushed = self.outer.flush()
        self._share_buffer_means()
        return flushed

    def _share_buffer_means(self) -> None:
        """The float buffers' mean over the groups was taken by each rank with its peers of the other
        groups, from its own buffers: the group's first rank's mean is made the group's, so that every
        rank of a group evaluates and saves the same BatchNorm statistics."""
        outer = self.outer
        if outer.buffer_means == self._buffer_means_shared:
            return
        self._buffer_means_shared = outer.buffer_means
        if dist.get_world_size(self.shard_group) > 1:
            source = dist.get_global_rank(self.shard_group, 0)
            broadcast_coalesced(outer.buffers, source, self.shard_group)
