"""Batches in the trainer: split into (inputs, targets), moved to the device, counted in samples."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from lockstep.errors import ConfigError


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
