"""The one door between checkpoints and the objects they hold: state_dict() / load_state_dict().

Checkpoints never import the engine or the data package. A wrapped model (torch's or lockstep's
DistributedDataParallel, or anything whose state_dict keys all start with `module.`) is stored under its
unprefixed keys and loads back into wrapped and bare models alike; a handle without state_dict() of its
own (lockstep.replicate) is reached through its `.module`. An entry whose state is each rank's own
(`RankStateful`: a sharded periodic run's shards mid-round) is written by every rank, under its rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

PREFIX = "module."
_SHOWN = 8


@runtime_checkable
class Stateful(Protocol):
    """What a checkpoint entry needs: a model, optimizer, scheduler, GradScaler, sampler, ..."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@runtime_checkable
class RankStateful(Protocol):
    """An entry whose state differs from rank to rank (each rank's own, none gathered): state_dict() gives this
    rank's, and load_state_dict() takes back what this rank saved. It loads only at the layout it was saved at
    (`rank_layout()`, recorded in meta.json); `layout_refusal(saved)` says why another cannot, and what to do."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...

    def rank_layout(self) -> dict[str, Any]: ...

    def layout_refusal(self, saved: dict[str, Any]) -> str: ...


def resolve(obj: Any) -> Any:
    """The object whose state is saved: `obj`, or `obj.module` for a handle that has no state_dict()."""
    if not isinstance(obj, Stateful) and isinstance(getattr(obj, "module", None), nn.Module):
        return obj.module
    return obj


def is_stateful(obj: Any) -> bool:
    return isinstance(resolve(obj), Stateful)


def gathers_state(obj: Any) -> bool:
    """Whether `obj` holds its state spread over the ranks and collects it with `consolidate_state_dict(to)`
    before `state_dict()` returns it whole (a sharded optimizer: lockstep's ShardedOptimizer, torch's
    ZeroRedundancyOptimizer). Its load_state_dict() takes the whole state and places it itself."""
    return callable(getattr(resolve(obj), "consolidate_state_dict", None))


def gather_state(obj: Any) -> None:
    """Collect the state of a `gathers_state` object on rank 0, where the checkpoint is written (a
    collective: every rank calls it); nothing for other objects."""
    if gathers_state(obj):
        resolve(obj).consolidate_state_dict(to=0)


def strip_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """Keys without the wrapper's `module.` prefix (only when every key has it)."""
    if state and all(isinstance(k, str) and k.startswith(PREFIX) for k in state):
        return {k[len(PREFIX) :]: v for k, v in state.items()}
    return dict(state)


def tensor_state(obj: Any) -> dict[str, torch.Tensor] | None:
    """The unprefixed state of `obj` when it is all tensors (safetensors-able), else None."""
    state = strip_prefix(obj.state_dict())
    if all(isinstance(v, torch.Tensor) for v in state.values()) and (state or isinstance(obj, nn.Module)):
        return state
    return None


def for_safetensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing memory (tied weights): what safetensors accepts."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        if storage and storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        out[key] = tensor
    return out


def module_mismatch(current: Mapping[str, Any], loaded: Mapping[str, Any]) -> str | None:
    """Missing keys, unexpected keys and shape mismatches between a model and a checkpoint, or None."""
    mine, theirs = strip_prefix(current), strip_prefix(loaded)
    missing = [k for k in mine if k not in theirs]
    unexpected = [k for k in theirs if k not in mine]
    shapes = [k for k in mine if k in theirs and _shape(mine[k]) != _shape(theirs[k])]
    if not (missing or unexpected or shapes):
        return None
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} missing (in the model, not in the checkpoint): "
            + _listing([f"{k} {_shape(mine[k])}" for k in missing])
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} unexpected (in the checkpoint, not in the model): "
            + _listing([f"{k} {_shape(theirs[k])}" for k in unexpected])
        )
    if shapes:
        parts.append(
            f"{len(shapes)} shape mismatches: "
            + _listing([f"{k} checkpoint {_shape(theirs[k])} vs model {_shape(mine[k])}" for k in shapes])
        )
    return "; ".join(parts)


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def _listing(items: list[str]) -> str:
    more = f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def keyed_like(loaded: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """`loaded` (unprefixed) with the `module.` prefix added when the target's keys carry it."""
    if current and all(isinstance(k, str) and k.startswith(PREFIX) for k in current):
        return {f"{PREFIX}{k}": v for k, v in strip_prefix(loaded).items()}
    return strip_prefix(loaded)


def placed_like(loaded: Any, current: Any) -> Any:
    """Move each loaded tensor to the device of the tensor at the same place in the object's current state.

    Where the current state has no tensor to follow, a tensor stays on the CPU (map_location="cpu").
    """
    if isinstance(loaded, torch.Tensor):
        return loaded.to(current.device) if isinstance(current, torch.Tensor) else loaded
    if isinstance(loaded, dict):
        here = current if isinstance(current, Mapping) else {}
        return {k: placed_like(v, here.get(k)) for k, v in loaded.items()}
    if isinstance(loaded, (list, tuple)):
        there = list(current) if isinstance(current, (list, tuple)) and len(current) == len(loaded) else []
        moved = [placed_like(v, there[i] if there else None) for i, v in enumerate(loaded)]
        return type(loaded)(moved) if isinstance(loaded, list) else tuple(moved)
    return loaded
