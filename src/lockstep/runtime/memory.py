"""Memory as a number for every run: the model state this rank holds, and the process's peak.

Why two numbers: the model state (parameters, gradients, optimizer state) is what sharding divides (ZeRO-1
divides the optimizer state, FSDP all three), so it is the number that shows a sharded run doing its job;
the peak is what the device or host actually had to give, activations and buffers included.

What `model_state_bytes` counts, on this rank:
- the module's parameters, their gradients (`.grad`) and the optimizer's state tensors (`optimizer.state`:
  a torch optimizer's, or a ShardedOptimizer's, which holds this rank's share only);
- local storage only: a DTensor (FSDP's `fully_shard`) counts its `to_local()` shard, never its global size;
- each byte once: tensors that share storage (tied parameters, gradients that are views of one bucket, a
  piece that views its parameter) count the union of the bytes they cover.

What it does not count: buffers (BatchNorm's running stats), DDP's or the engine's own communication
buckets (copies in flight, not model state; gradients that *are* views of a bucket do count), a
ShardedOptimizer's transient consolidated copy, activations, and the CUDA caching allocator's slack. Those
show in the peak.

Gradients exist only between a step's backward and its `zero_grad(set_to_none=True)`, so the meter samples
there (trainer/run/steps.py, once per run: the layout does not change from step to step).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

CUDA_ALLOCATOR = "cuda_allocator"  # torch.cuda.max_memory_allocated: tensors only, not the cache
PROCESS_MAX_RSS = "process_max_rss"  # getrusage's peak resident set: the whole process


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state on this rank. `total` is the union over the three parts, so a storage shared
    between parts (unusual) counts once there; otherwise it is their sum."""

    params: int
    grads: int
    optimizer: int
    total: int


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process stores: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storage that `tensors` cover (each DTensor by its local shard).

    Per storage, the union of the byte ranges the tensors span: tied or aliased tensors count once, views
    of one buffer count what they cover (not the whole buffer). A non-contiguous view counts the span from
    its first to its last element."""
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for number, tensor in enumerate(tensors):
        t = local(tensor)
        if t.numel() == 0:
            continue
        start = int(t.storage_offset()) * t.element_size()
        extent = (sum((int(n) - 1) * abs(s) for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        pointer = t.untyped_storage().data_ptr()
        key = (str(t.device), pointer) if pointer else ("unshared", number)  # meta and the like: alone
        ranges.setdefault(key, []).append((start, start + extent))
    return sum(_union_length(spans) for spans in ranges.values())


def _union_length(spans: list[tuple[int, int]]) -> int:
    """Length of the union of half-open ranges."""
    total, reached = 0, -1
    for start, end in sorted(spans):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def optimizer_state_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `optimizer.state` (nested dicts, lists and tuples walked): a torch optimizer's whole
    state, a ShardedOptimizer's share (its `state` holds this rank's units only)."""
    yield from _tensors_in(list(getattr(optimizer, "state", {}).values()))


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def model_state_bytes(module: nn.Module, optimizer: Any) -> ModelStateBytes:
    """What `module`'s parameters, their gradients and `optimizer`'s state take on this rank (see the
    module doc). `optimizer`: the run's own (a torch optimizer or a ShardedOptimizer), not a wrapper that
    only steps it."""
    params = list(module.parameters())  # each parameter once, tied ones included once
    grads = [p.grad for p in params if p.grad is not None]
    state = list(optimizer_state_tensors(optimizer))
    return ModelStateBytes(
        params=tensor_bytes(params),
        grads=tensor_bytes(grads),
        optimizer=tensor_bytes(state),
        total=tensor_bytes([*params, *grads, *state]),
    )


def peak_bytes(device: torch.device) -> tuple[int, str]:
    """The run's peak memory so far and where it comes from: on CUDA the allocator's peak of tensor bytes
    on `device`; elsewhere the process's peak resident set (host memory: everything the process touched)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), CUDA_ALLOCATOR
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024), PROCESS_MAX_RSS  # Linux: KiB


def module_device(module: nn.Module) -> torch.device:
    """Where `module`'s parameters live (a DTensor's local shard's device); the CPU for a module without any."""
    for p in module.parameters():
        return local(p).device
    return torch.device("cpu")


class MemoryMeter:
    """Keeps a run's model-state bytes, sampled on the first `sample()` (a step's, after its backward and
    before zero_grad, when the gradients exist); later calls cost one attribute check."""

    def __init__(self) -> None:
        self.model_state: ModelStateBytes | None = None
        self.sampled_at: str | None = None  # "step", or "end" when no step sampled it (grads then absent)

    def sample(self, module: nn.Module, optimizer: Any) -> None:
        """Count the model state now, unless it was counted already."""
        if self.model_state is None:
            self.model_state = model_state_bytes(module, optimizer)
            self.sampled_at = "step"

    def summary(self, module: nn.Module, optimizer: Any) -> dict[str, Any]:
        """summary.json's `memory`: the model state as sampled (counted now, gradients absent, for a run
        that took no step) and the peak so far."""
        if self.model_state is None:
            self.model_state = model_state_bytes(module, optimizer)
            self.sampled_at = "end"
        state = self.model_state
        peak, source = peak_bytes(module_device(module))
        return {
            "model_state_bytes": state.total,
            "params_bytes": state.params,
            "grads_bytes": state.grads,
            "optimizer_bytes": state.optimizer,
            "sampled_at": self.sampled_at,
            "peak_bytes": peak,
            "peak_source": source,
        }
