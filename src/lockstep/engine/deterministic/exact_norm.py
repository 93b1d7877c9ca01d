"""Deterministic mode's gradient norm: one exact value whatever the layout, for clipping.

torch's clip_grad_norm_ sums squares in float: on sharded gradients each rank sums its shard and the
partial sums are all-reduced, so the norm, and every clipped gradient after it, depends on how the model
is cut (FSDP 4 and FSDP 2 disagree in the last bits). Here the squares go onto one fixed-point grid: the
largest |g| over all gradients (an exact MAX) fixes a power of two 2**t such that every square, and their
sum over the whole model, stays below 2**62; each g**2 (exact in float64 for float32 g) times 2**t is
rounded to an integer and summed in int64, locally and across the shards: exact in any order. The norm is
sqrt(sum * 2**-t), the same bits in a replicated run (every rank holds every gradient and communicates
nothing) and in any sharded layout. Squares below 2**-(62 - log2 n) of the largest vanish: far below
float32's rounding of the norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

SUM_BITS = 62  # the int64 sum's magnitude stays below 2**62


@torch.no_grad()
def exact_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the parameters' gradients (float32, 0-d): exact, the same bits at any sharding."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(
            (), dtype=torch.float32, device="cpu"
        )  # no gradient: nothing to clip, no collective
    groups = _shard_groups(grads)
    local = [_local(g) for g in grads]
    device = local[0].device
    largest = torch.stack([_largest(t) for t in local]).max()
    # [the largest finite magnitude, whether any element is NaN]: a float MAX may drop a NaN on its way
    summary = torch.stack([largest.nan_to_num(nan=0.0), largest.isnan().to(torch.float64)])
    for group in groups:
        dist.all_reduce(summary, op=dist.ReduceOp.MAX, group=group)
    if bool(summary[1] > 0):
        return torch.tensor(float("nan"), dtype=torch.float32, device=device)
    largest = summary[0]
    if not bool(torch.isfinite(largest)):
        return largest.float()
    if float(largest) == 0.0:
        return torch.zeros((), dtype=torch.float32, device=device)
    count = sum(g.numel() for g in grads)  # the global element count: the same at any layout
    exponent = 2 * math.frexp(float(largest))[1]  # largest < 2**e, so largest**2 < 2**(2e)
    shift = SUM_BITS - max(math.ceil(math.log2(count)), 0) - exponent
    scale = math.ldexp(1.0, shift)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for t in local:
        total += t.to(torch.float64).square_().mul_(scale).round_().to(torch.int64).sum()
    for group in groups:
        dist.all_reduce(total, group=group)
    return torch.tensor(
        math.sqrt(math.ldexp(float(total.item()), -shift)), dtype=torch.float32, device=device
    )


@torch.no_grad()
def exact_clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s rule (coefficient max_norm / (norm + 1e-6), at most 1) on the exact
    norm; returns the norm."""
    params = list(params)
    norm = exact_grad_norm(params)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef.to(p.grad.device))
    return norm


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _largest(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    low, high = torch.aminmax(t)
    return torch.maximum(high, -low).to(torch.float64)


def _shard_groups(grads: list[torch.Tensor]) -> list[dist.ProcessGroup]:
    """The groups a sharded gradient is cut over (its mesh's Shard dimensions); none for plain tensors."""
    for g in grads:
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            return [
                mesh.get_group(d) for d, placement in enumerate(g.placements) if isinstance(placement, Shard)
            ]
    return []
