"""A process group in which communication is free: one process joins as rank 0 of a world of W, and every
collective completes at once.

An engine measured on it does all of its own work (hooks, bucket copies, launching each all-reduce,
scaling, writing back) and nothing else, so the time it adds to a bare model's step is the engine's own
cost (DESIGN.md, "Measuring an engine's own cost"). What each collective leaves in its tensors is what
W identical ranks would see: an all-reduce or a broadcast leaves them as they are (an average over W equal
values is the value itself; the engines divide before they sum, as each of W ranks would), an all-gather
copies this rank's tensor into every slot. So wrap-time checks (every rank built the same model) pass,
and the gradients an engine leaves are the bare model's divided by W.

    import benchmarks.noop_group as noop
    noop.init(world_size=8)          # torch.distributed's default group, on the "lockstep-noop" backend
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "lockstep-noop"


class DoneWork(dist._Work):  # type: ignore[misc, name-defined]  # torch's Python base for a backend's Work
    """A collective that has already completed, with its result in a completed Future."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class NoOpProcessGroup(dist.ProcessGroup):
    """Rank `rank` of `world_size` identical ranks that never talk (see the module doc)."""

    def getBackendName(self) -> str:  # noqa: N802  torch's name
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> DoneWork:
        return DoneWork(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> DoneWork:
        return DoneWork(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> DoneWork:
        return DoneWork(tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> DoneWork:
        for slots, tensor in zip(outputs, inputs):
            for slot in slots:
                slot.copy_(tensor)
        return DoneWork(outputs)

    def _allgather_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> DoneWork:
        output.view(self.size(), -1).copy_(tensor.reshape(1, -1))
        return DoneWork([output])

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> DoneWork:
        for output, chunks in zip(outputs, inputs):
            output.copy_(chunks[self.rank()])
        return DoneWork(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> DoneWork:
        output.copy_(tensor.reshape(self.size(), -1)[self.rank()].view_as(output))
        return DoneWork([output])

    def barrier(self, opts: Any = None) -> DoneWork:
        return DoneWork([])


def _create(common_opts: Any, backend_opts: Any = None) -> NoOpProcessGroup:
    return NoOpProcessGroup(common_opts.group_rank, common_opts.group_size)


def init(world_size: int, rank: int = 0) -> None:
    """This process becomes `rank` of `world_size` on a no-op default group."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
