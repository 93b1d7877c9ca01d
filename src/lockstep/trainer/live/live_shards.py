"""Live mode inside a sharded fit (issue 46): a replacement group receives its state shard for shard.

A replica group that joins a running sharded run holds no state of its own. Each of its ranks receives,
from the member that holds the same shard in a live group (the lowest such rank still holding the run's
state), that rank's local shards of the parameters, its buffers and its optimizer state for those shards:
one broadcast in each replicate group (the ranks that hold the same shard, one per replica group), never
the whole model through rank 0. The rest of the run's state (counters, sampler, schedule, the optimizer's
hyperparameters) comes from rank 0 as for a replicated run (runtime/membership/recovery.py).

A surviving group's own model moves to the new group's meshes with its local shards (engine/sharded/
rebuild.py): nothing crosses the groups for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep.engine.sharded import ShardHandle
from lockstep.errors import InternalError
from lockstep.runtime.progress import STATE_TRANSFER, phase
from lockstep.runtime.state_transfer import broadcast_state


def share_shards(
    handle: ShardHandle, optimizer: torch.optim.Optimizer, holders: list[int], *, joining: bool
) -> None:
    """Every rank of the new group: the ranks of each replicate group that lack the run's state receive the
    local state of the lowest one of `holders` (ranks that hold it) in that group (a collective)."""
    group = handle.layout.replicate_group
    if group is None:
        raise InternalError("a replacement group joined a sharded run that has one replica group")
    peers = dist.get_process_group_ranks(group)
    sources = [rank for rank in peers if rank in holders]
    if not sources:
        raise InternalError(f"no rank of replicate group {peers} holds the run's state (holders {holders})")
    src = sources[0]
    mine = local_state(handle.module, optimizer) if dist.get_rank() == src else None
    with phase(STATE_TRANSFER):
        tree = broadcast_state(mine, src=src, group=group)
    if joining:
        load_local_state(handle.module, optimizer, tree)


def local_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's local shards of `module`'s parameters, its buffers, and the optimizer's state of those
    shards by parameter name (a DTensor value as its local tensor; other values, as the step, as they are)."""
    names = {id(p): name for name, p in module.named_parameters()}
    sharded: dict[str, dict[str, torch.Tensor]] = {}
    plain: dict[str, dict[str, Any]] = {}
    for param, values in optimizer.state.items():
        name = names[id(param)]
        sharded[name] = {k: v.to_local() for k, v in values.items() if isinstance(v, DTensor)}
        plain[name] = {k: v for k, v in values.items() if not isinstance(v, DTensor)}
    return {
        "params": {name: _local(p).detach() for name, p in module.named_parameters()},
        "buffers": {name: b.detach() for name, b in module.named_buffers()},
        "optimizer_sharded": sharded,
        "optimizer_plain": plain,
    }


def load_local_state(module: nn.Module, optimizer: torch.optim.Optimizer, tree: dict[str, Any]) -> None:
    """Put `local_state`'s tree into this rank's `module` and `optimizer` (the same shard of the same layout)."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            _local(param).copy_(tree["params"][name])
        for name, buffer in module.named_buffers():
            buffer.copy_(tree["buffers"][name])
    optimizer.state.clear()
    for name, plain in tree["optimizer_plain"].items():
        param = params[name]
        values = dict(plain)
        for key, local in tree["optimizer_sharded"][name].items():
            values[key] = _on_mesh_of(param, local)
        optimizer.state[param] = values


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _on_mesh_of(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as the DTensor of `param`'s layout (the optimizer's state of a sharded parameter)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )
