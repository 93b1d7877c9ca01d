"""fit's replica of the model over the current group: lockstep's handle, or torch's drop-in face.

A `FitReplica` is a part of `FitRun` (trainer/loop.py): the model the steps run, the replica handle when
the module is replicated in place, and this rank's place in the group (`topo`). The replica is made
through the run's step driver (trainer/run/step_driver.py), so that in live mode a member lost in its
start-up collectives is survived like any other. When the group changes, `release()` drops the replica
(nothing may keep the old group alive) and `rebuild(topology)` replicates the module over the new group;
the objects that follow the handle (a low-communication run's outer state, the stepper that syncs after
each step) are rebound to it (`followers`). A sharded module cannot move to a new group: in live mode its
local shards are taken as it goes, and it is cut anew over the new group, a new module object
(engine/sharded/rebuild.py; the run moves its optimizer onto it).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn

from lockstep.engine import DistributedDataParallel, ReplicaHandle, replicate
from lockstep.engine.sharded import ShardHandle, ShardPolicy, shard
from lockstep.engine.sharded.rebuild import ShardedState, meta_skeleton, shard_again, shard_joining
from lockstep.runtime.env.topology import Topology
from lockstep.trainer.run.buckets import fit_policy
from lockstep.trainer.run.low_comm import engine_policy
from lockstep.trainer.run.step_driver import StepDriver
from lockstep.trainer.settings.config import FitConfig


class Follower(Protocol):
    """What follows the replica handle when it is rebuilt on a new group."""

    def rebind(self, handle: Any) -> None: ...


class Start(Protocol):
    """The run's side that the replica starts through: its step driver, and this rank's place after it;
    whether its group can change under the run (`regroups`), and whether this rank joins a running one."""

    driver: StepDriver
    regroups: bool

    @property
    def joining(self) -> bool: ...

    def topology(self) -> Topology: ...


class FitReplica:
    """The model fit's steps run, over the current group (see the module doc); with config.shard_degree > 1
    the module cut into shards by torch's FSDP2 (`shard`), stepped as itself."""

    def __init__(
        self, module: nn.Module, config: FitConfig, device: torch.device, start: Start, *, in_place: bool
    ) -> None:
        """`in_place`: the module replicated in place, stepped through the handle (accumulate() in
        deterministic and live mode, a low-communication run, bucket_cap_mb="auto"); else torch's
        drop-in face."""
        self.module, self.config = module, config
        self.handle: ReplicaHandle | ShardHandle | None = None
        self.followers: list[Follower] = []
        self.model: nn.Module = module
        self.skeleton: nn.Module | None = None  # live mode, sharded: the module's structure on no device
        self.taken: ShardedState | None = None  # live mode, sharded: this rank's shards, between groups
        if config.shard_degree > 1:  # FSDP2 units in shard groups (engine/sharded): the module is the model
            # a periodic sync: the replica groups meet every sync_every steps
            periodic = engine_policy(config)
            cut = self.cut = ShardPolicy(
                shard_degree=config.shard_degree,
                reshard_after_forward=config.reshard_after_forward,
                deterministic=config.deterministic,
                sync=periodic if periodic.periodic else None,
            )
            if start.regroups:
                self.skeleton = meta_skeleton(module)
            # a replacement's own values are replaced by its group's shards: the run's ranks need not agree
            cutter = shard_joining if start.joining else shard
            self.handle = start.driver.run(lambda: cutter(module, cut))
        elif in_place:
            policy = fit_policy(config)
            self.handle = start.driver.run(lambda: replicate(module, policy=policy))
        else:
            self.model = DistributedDataParallel(
                module,
                device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=cast("float | None", config.bucket_cap_mb),  # a number or None: torch's
                gradient_as_bucket_view=config.shard_optimizer,  # sharded: one copy of the gradients
            )
        self.topo: Topology = start.topology()  # live mode: the members may have changed meanwhile

    @property
    def engine(self) -> Any:
        """What the engine's statistics come from: the handle, or torch's drop-in face."""
        return self.handle or self.model

    def release(self) -> None:
        """Drop the replica (live mode, the group is changing); a sharded one's local shards are kept."""
        if isinstance(self.handle, ShardHandle) and self.skeleton is not None:
            self.taken = ShardedState.take(self.handle, self.skeleton)
        elif self.handle is not None:
            self.handle.remove()
        self.handle = None

    def rebuild(self, topology: Topology) -> dict[str, nn.Parameter] | None:
        """Replicate the module over the group just formed; its followers take the new handle. A sharded
        module is cut anew (a new module object): the old sharded parameters by name, which the optimizer
        holds (None when the module stayed)."""
        self.topo = topology
        if self.taken is not None:
            self.handle = shard_again(self.taken, self.cut)
            self.module = self.model = self.handle.module
            taken, self.taken = self.taken, None
            return taken.params
        self.handle = replicate(self.module, policy=fit_policy(self.config))
        for follower in self.followers:
            follower.rebind(self.handle)
        return None
