"""A background save's copy of a checkpoint's entries in CPU memory, reused from one save to the next.

At the step boundary the writer rank copies every tensor of the collected entries (serialize.collect)
into CPU buffers it keeps between saves (one copy per tensor, allocated at the first save and again only
when a tensor's shape or dtype changes; page-locked when CUDA is there, so the device copies run
asynchronously and one synchronize ends them); everything else is deep-copied. Training may then change
the objects while the writer thread encodes and writes the copy. The next save waits for that write before
it refills the buffers (at most one write in flight).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lockstep.checkpoint.serialize import Entry
from lockstep.torch_private import copy_state_dict, create_cpu_state_dict


class CpuSnapshot:
    """Reusable CPU buffers, keyed by entry and position in the entry's state."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._pin = torch.cuda.is_available()

    @property
    def nbytes(self) -> int:
        """CPU memory the buffers hold (the cost of a background save, besides the write itself)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, entries: list[Entry]) -> list[Entry]:
        """Entries whose tensors are this snapshot's CPU copies (the same values, no memory shared)."""
        taken = [Entry(e.name, e.kind, self._copy(e.payload, (e.name, "")), e.type_name) for e in entries]
        if self._pin:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies are complete
        return taken

    def _copy(self, value: Any, key: tuple[str, str]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, key)
        if isinstance(value, dict):
            return type(value)((k, self._copy(v, (key[0], f"{key[1]}/{k}"))) for k, v in value.items())
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._copy(v, (key[0], f"{key[1]}[{i}]")) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, key: tuple[str, str]) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.is_sparse or tensor.layout != torch.strided:
            return tensor.to("cpu", copy=True)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin and tensor.is_cuda)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=self._pin)
        return buffer


class ShardSnapshot:
    """A sharded run's CPU copy of this rank's shards (DTensors keep their layout, with CPU local tensors:
    torch.distributed.checkpoint's own staging), reused while the shapes and dtypes stay the same."""

    def __init__(self) -> None:
        self._copy: dict[str, Any] | None = None
        self._signature: list[Any] = []
        self._pin = torch.cuda.is_available()

    @property
    def nbytes(self) -> int:
        return sum(_local(t).numel() * t.element_size() for t in _tensors(self._copy))

    def take(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` (a DCP state dict of this rank's shards) with every tensor copied into the CPU buffers."""
        signature = [(tuple(_local(t).shape), t.dtype) for t in _tensors(state)]
        if self._copy is None or signature != self._signature:
            self._copy = create_cpu_state_dict(state, pin_memory=self._pin)
            self._signature = signature
        taken = copy_state_dict(state, self._copy, non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize()
        return taken


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []
