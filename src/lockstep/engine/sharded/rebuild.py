"""A sharded model carried onto a new world: what live mode's surviving replica groups do after a
re-formation (issue 46; docs/notes/live_sharded_groups.md).

A re-formation destroys every process group, FSDP2's shard groups included, and FSDP2 cannot move a module
to another mesh (its groups are looked up by name, and the names of a destroyed world resolve to nothing, or
to another group). So a surviving group builds its model anew, with public APIs only:

1. `meta_skeleton(module)`, taken before `shard()` (trainer/run/replica.py): the module's structure on the
   meta device (no memory), with its parameters' tying kept.
2. `ShardedState.take(handle, skeleton)` as the old group goes (live recovery's `release_replica`, while its groups
   still exist): FSDP2's per-iteration state reset (`reset_iter_state()`: a step that failed mid-backward
   otherwise leaves plain unsharded parameters registered), then each parameter's local shard and each
   buffer, by name, and each submodule's train/eval mode.
3. `shard_again(state, policy)` on the new world: a copy of the skeleton cut by the same units on the new
   mesh, materialized (`to_empty`) and filled with the local shards and buffers. Replica groups leave the
   world whole and each survivor keeps its place in its group, so its local shards are the new layout's.
4. `move_optimizer(optimizer, old, new)`: the optimizer object stays (the scheduler holds it); its
   parameters and state move to the new ones, each DTensor state value remade on its new parameter's mesh
   and placements (HSDP's mesh is 2-D at two groups or more, 1-D at one).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lockstep.engine.sharded.handle import ShardHandle, ShardLayout, ShardPolicy, shard_layout
from lockstep.engine.sharded.units import check_shardable, choose_units
from lockstep.errors import InternalError
from lockstep.plan import check_shard_layout
from lockstep.torch_private import fsdp_initialized

_LAYOUTS = itertools.count(1)  # the layouts this process cut a model over anew
FAILED_RESET = (RuntimeError, ValueError)  # a reset that waits on work of a group with a dead member


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A copy of `module` whose parameters and buffers are on the meta device (no memory is copied);
    parameters tied in `module` are tied in the copy."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(module, memo)


@dataclass
class ShardedState:
    """One rank's share of a sharded model, taken from it as its group goes (see the module doc)."""

    skeleton: nn.Module
    params: dict[str, nn.Parameter]  # the old sharded parameters, by name (the optimizer's keys)
    locals_: dict[str, torch.Tensor]  # each one's local shard
    buffers: dict[str, torch.Tensor]
    training: dict[str, bool]  # each submodule's train/eval mode, by name
    device: torch.device
    counts: tuple[int, int, int, int]  # what the old handle counted (ShardHandle.carried)

    @classmethod
    def take(cls, handle: ShardHandle, skeleton: nn.Module) -> ShardedState:
        """This rank's local shards and buffers of `handle`'s module, after resetting FSDP2's per-iteration
        state (a failed step's half-gathered parameters resharded), and what the handle counted."""
        module = handle.module
        if isinstance(module, FSDPModule) and fsdp_initialized(module):  # before a forward: nothing to reset
            try:
                module.reset_iter_state()
            except FAILED_RESET:  # its group lost a member: what it waited on will not come, and is dropped
                pass
        params = dict(module.named_parameters())
        unsharded = [name for name, p in params.items() if not isinstance(p, DTensor)]
        if unsharded:  # a reset that failed half-way: these are gathered values, not this rank's shards
            raise InternalError(
                f"{handle.tag}the sharded model could not be reset after a lost member (parameters "
                f"{unsharded[:3]} are not sharded): it cannot be carried onto the new group; resume from the "
                "last checkpoint"
            )
        locals_ = {name: _local(p) for name, p in params.items()}
        buffers = {name: b.detach() for name, b in module.named_buffers()}
        device = next(iter(locals_.values())).device
        extras = handle.stats().extras
        counts = (
            int(extras["bytes_communicated_total"]),
            int(extras["bytes_in_group"]),
            handle.carried[2] + handle.micro_steps.steps,
            int(extras["steps_redone"]),
        )
        training = {name: m.training for name, m in module.named_modules()}
        return cls(skeleton, params, locals_, buffers, training, device, counts)


def shard_again(state: ShardedState, policy: ShardPolicy) -> ShardHandle:
    """The model of `state` cut anew over the current (new) world by `policy`'s units and layout, holding
    this rank's local shards and buffers; its handle counts on from the old one's figures."""
    module = copy.deepcopy(state.skeleton)
    layout, units = _cut(module, policy, state.device.type)
    module.to_empty(device=state.device)
    with torch.no_grad():
        for name, param in module.named_parameters():
            _local(param).copy_(state.locals_[name])
        for name, buffer in module.named_buffers():
            buffer.copy_(state.buffers[name])
    for name, submodule in module.named_modules():
        submodule.training = state.training.get(name, submodule.training)
    handle = ShardHandle(module, units, layout, policy)
    handle.carried = state.counts
    return handle


def shard_joining(module: nn.Module, policy: ShardPolicy) -> ShardHandle:
    """A replacement's model cut over the world it joins, as the members cut theirs anew (`shard_again`:
    the same collectives); its values are replaced by its replica group's shards (trainer/live/
    live_shards.py), so unlike `shard()` it does not make the ranks agree on them first."""
    check_shardable(module)
    layout, units = _cut(module, policy, next(p.device.type for p in module.parameters()))
    return ShardHandle(module, units, layout, policy)


def _cut(module: nn.Module, policy: ShardPolicy, device_type: str) -> tuple[ShardLayout, list[nn.Module]]:
    """`module` cut by `policy`'s units over the current world's layout (its collectives: the meshes')."""
    world = dist.get_world_size()
    degree = policy.shard_degree or world
    check_shard_layout(world, degree)
    own_cross_sums = policy.deterministic or policy.periodic
    tag = f"@{next(_LAYOUTS)}"  # a mesh unequal to every earlier one (shard_layout)
    layout = shard_layout(degree, device_type=device_type, deterministic=own_cross_sums, tag=tag)
    units = choose_units(module, policy.units)
    for unit in units:
        fully_shard(unit, mesh=layout.mesh, reshard_after_forward=policy.reshard_after_forward)
    fully_shard(module, mesh=layout.mesh, reshard_after_forward=policy.reshard_after_forward)
    return layout, units


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def move_optimizer(optimizer: torch.optim.Optimizer, old: dict[str, nn.Parameter], new: nn.Module) -> None:
    """`optimizer`'s parameters and state moved from `old` (by name) to `new`'s parameters of the same
    names: each DTensor state value remade on its new parameter's mesh from its local tensor (no copy)."""
    by_id = {id(p): name for name, p in old.items()}
    params = dict(new.named_parameters())
    moved: dict[Any, Any] = {}
    for group in optimizer.param_groups:
        fresh = []
        for p in group["params"]:
            q = params[by_id[id(p)]]
            fresh.append(q)
            if p in optimizer.state:
                moved[q] = {key: _remade(value, q) for key, value in optimizer.state[p].items()}
        group["params"] = fresh
    optimizer.state.clear()
    optimizer.state.update(moved)


def _remade(value: Any, param: torch.Tensor) -> Any:
    if not isinstance(value, DTensor) or not isinstance(param, DTensor):
        return value
    return DTensor.from_local(
        value.to_local(),
        param.device_mesh,
        param.placements,
        shape=value.shape,
        stride=value.stride(),
        run_check=False,
    )
