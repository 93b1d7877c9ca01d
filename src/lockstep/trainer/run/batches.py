"""Batches in the trainer: how a step's global batch is cut, split into (inputs, targets), moved, counted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lockstep.errors import ConfigError, InternalError
from lockstep.torch_private import pytree


class BatchSettings(Protocol):
    batch_size: int
    grad_accum_steps: int
    global_batch_size: int | None
    micro_batch_size: int | None
    deterministic: bool


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples are cut: the same global batch, split by world size or not."""

    global_batch_size: int
    micro_batch_size: int  # samples of one forward/backward
    micro_batches_per_rank: int  # default mode: forward/backward passes per rank and step
    num_micro_batches: int  # deterministic and live mode: micro-batches per step over all ranks (0 otherwise)


def plan_batches(config: BatchSettings, world_size: int) -> BatchPlan:
    """The step's cut for `config` on `world_size` ranks, or a ConfigError naming the sizes to change.
    (Live mode cuts its steps its own way: trainer/live/live_side.py, `live_batch_plan`.)"""
    total = config.global_batch_size
    if total is None:
        if config.deterministic:  # the run's plan refused it at the door (lockstep/plan.py, VALUE_CHECKS)
            raise InternalError("deterministic mode without a global batch reached the batch cut")
        per_rank = config.batch_size * config.grad_accum_steps
        return BatchPlan(per_rank * world_size, config.batch_size, config.grad_accum_steps, 0)
    if config.deterministic:
        return micro_batch_cut(config, total)
    if total % world_size:
        raise ConfigError(
            f"global_batch_size={total} does not split evenly over {world_size} ranks; choose a multiple of "
            f"{world_size}, or use deterministic=True (micro-batches need not match the ranks)"
        )
    share = total // world_size
    micro = config.micro_batch_size or share
    if share % micro:
        raise ConfigError(
            f"each of {world_size} ranks takes {share} samples of global_batch_size={total}, not a multiple of "
            f"micro_batch_size={micro}; choose a micro_batch_size that divides {share}"
        )
    return BatchPlan(total, micro, share // micro, 0)


def micro_batch_cut(config: BatchSettings, total: int) -> BatchPlan:
    """A global batch of `total` samples as whole micro-batches of a fixed size, at any world size."""
    micro = config.micro_batch_size or min(config.batch_size, total)
    if total % micro:
        raise ConfigError(
            f"global_batch_size={total} is not a multiple of the micro-batch size {micro} "
            f"({'micro_batch_size' if config.micro_batch_size else 'batch_size'}); a step is cut into whole "
            "micro-batches (deterministic and live mode): choose a micro_batch_size that divides it"
        )
    return BatchPlan(total, micro, 0, total // micro)


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a nest of lists, tuples, namedtuples and dicts on `device`; the nest keeps its types.

    torch's pytree rebuilds each container as its own type (a namedtuple stays that namedtuple, an
    OrderedDict stays ordered); other leaves (str, int, objects) are returned as they are. The copy is
    asynchronous only from pinned memory, where it is safe.
    """
    return pytree.tree_map(lambda leaf: _move(leaf, device), batch)


def _move(leaf: Any, device: torch.device) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    return leaf.to(device, non_blocking=leaf.device.type == "cpu" and leaf.is_pinned())


def split_batch(batch: Any) -> tuple[Any, Any]:
    """A loader's batch as (inputs, targets): fit trains `loss_fn(model(inputs), targets)`."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    seen = f"a {type(batch).__name__}" + (
        f" of {len(batch)}" if isinstance(batch, (tuple, list, dict)) else ""
    )
    raise ConfigError(
        f"fit needs each batch to be a pair (inputs, targets), got {seen}: make the dataset's __getitem__ return "
        "(inputs, targets) (either may be a tensor, a tuple or a dict of tensors)"
    )


def batch_len(targets: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (targets may be a tensor, tuple or dict)."""
    for leaf in pytree.tree_leaves(targets):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    if isinstance(targets, (list, tuple)):
        return len(targets)
    raise ConfigError(
        f"cannot count the samples of a batch whose targets are {type(targets).__name__}: fit needs a tensor "
        "(or a tuple/dict of tensors) with the batch as its first dimension"
    )
