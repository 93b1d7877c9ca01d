"""Small typed collectives that every layer needs: rank queries, barrier, scalar means, JSON objects.

Objects travel as JSON, never pickle: a peer's bytes are data, not code (torch's *_object collectives
unpickle whatever arrives). Each helper also works without a process group (a world of 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lockstep.runtime.waits import tracked, wait_watching_membership


def _active(group: dist.ProcessGroup | None = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """True on global rank 0 (and in a world of 1)."""
    return get_rank() == 0


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device on which this group's backend expects lockstep's own tensors (cuda for nccl, else cpu).

    Every tensor that lockstep creates for a collective (flags, counts, JSON payloads, join records) is
    made on this device: an NCCL group rejects CPU tensors.
    """
    if not _active(group):
        return torch.device("cpu")
    backend = str(dist.get_backend(group))
    capability = dist.Backend.backend_capability.get(backend.lower(), ["cpu"])
    return device_for_backend(capability, lambda: torch.cuda.current_device())


def device_for_backend(capability: Sequence[str], current_index: Callable[[], int]) -> torch.device:
    """cpu when the backend takes CPU tensors (gloo, mpi), else its accelerator's current device (nccl)."""
    if "cpu" in capability or not capability:
        return torch.device("cpu")
    return torch.device(capability[0], current_index())


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` (default: the world) gets here; without a process group, or in a
    world of 1, return at once."""
    if _active(group):
        with tracked("barrier", (), group, publish=True):
            wait_watching_membership(dist.barrier(group, async_op=True))


@contextmanager
def main_process_first(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Rank 0 runs the block first (download, preprocess, cache); the others run it after."""
    if not is_main():
        barrier(group)
    try:
        yield
    finally:
        if is_main():
            barrier(group)


def all_reduce_mean(
    value: float | torch.Tensor | Sequence[float], group: dist.ProcessGroup | None = None
) -> Any:
    """Mean over ranks of a scalar, a sequence of scalars (one packed all-reduce) or a tensor."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to(comm_device(group), torch.float64)
        if _active(group):
            with tracked("allreduce (mean)", (tensor,), group, publish=True):
                wait_watching_membership(dist.all_reduce(tensor, group=group, async_op=True))
            tensor /= dist.get_world_size(group)
        return tensor.to(value.device)
    is_scalar = isinstance(value, (int, float))
    values = [float(value)] if isinstance(value, (int, float)) else list(value)
    packed = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    if _active(group):
        with tracked("allreduce (mean)", (packed,), group, publish=True):
            wait_watching_membership(dist.all_reduce(packed, group=group, async_op=True))
        packed /= dist.get_world_size(group)
    means: list[float] = packed.tolist()
    return means[0] if is_scalar else means


def all_reduce_sum(values: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum over ranks of a sequence of scalars, packed into one all-reduce (counts, metric sums)."""
    packed = torch.tensor(list(values), dtype=torch.float64, device=comm_device(group))
    if _active(group):
        with tracked("allreduce (sum)", (packed,), group, publish=True):
            wait_watching_membership(dist.all_reduce(packed, group=group, async_op=True))
    return packed.tolist()


def gather_rows(
    rows: dict[int, torch.Tensor], num_rows: int, group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Every rank's float64 rows, by ordinal, on every rank: row i comes from the one rank that holds it.

    `rows` maps ordinals in [0, num_rows) to 1-D tensors (lengths may differ); every ordinal is held by
    exactly one rank. Two all-reduces of zero-filled buffers (lengths, then values): each element has one
    non-zero contributor, so the sums are exact whatever the world size or the reduction order, and nothing
    is unpickled. Deterministic mode exchanges metrics and BatchNorm statistics this way.
    """
    device = comm_device(group)
    lengths = torch.zeros(num_rows, dtype=torch.int64, device=device)
    for ordinal, row in rows.items():
        lengths[ordinal] = row.numel()
    if _active(group):
        with tracked("allreduce (row lengths)", (lengths,), group, publish=True):
            wait_watching_membership(dist.all_reduce(lengths, group=group, async_op=True))
    sizes = lengths.tolist()
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    flat = torch.zeros(offsets[-1], dtype=torch.float64, device=device)
    for ordinal, row in rows.items():
        flat[offsets[ordinal] : offsets[ordinal + 1]] = row.detach().to(device, torch.float64)
    if _active(group):
        with tracked("allreduce (rows)", (flat,), group, publish=True):
            wait_watching_membership(dist.all_reduce(flat, group=group, async_op=True))
    flat = torch.where(flat == 0, 0.0, flat)  # -0.0 + 0.0 is +0.0: make a world of 1 agree with the others
    return [flat[offsets[i] : offsets[i + 1]] for i in range(num_rows)]


def _encode(obj: Any) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _decode(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.cpu().tolist()).decode())


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Send a JSON-serializable object from `src` (a global rank) to every rank; return it everywhere."""
    if not _active(group):
        return obj
    device = comm_device(group)
    payload = _encode(obj).to(device) if get_rank() == src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    with tracked("broadcast (object size)", (size,), group, publish=True):
        wait_watching_membership(dist.broadcast(size, src=src, group=group, async_op=True))
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    with tracked("broadcast (object)", (payload,), group, publish=True):
        wait_watching_membership(dist.broadcast(payload, src=src, group=group, async_op=True))
    return _decode(payload)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON-serializable object, in rank order, on every rank."""
    if not _active(group):
        return [obj]
    device = comm_device(group)
    world = dist.get_world_size(group)
    payload = _encode(obj).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    with tracked("allgather (object sizes)", (size,), group, publish=True):
        wait_watching_membership(dist.all_gather(sizes, size, group=group, async_op=True))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world)]
    with tracked("allgather (objects)", (padded,), group, publish=True):
        wait_watching_membership(dist.all_gather(gathered, padded, group=group, async_op=True))
    return [_decode(t[: int(s.item())]) for t, s in zip(gathered, sizes)]
