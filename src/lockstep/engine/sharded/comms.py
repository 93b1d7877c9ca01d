"""FSDP2's all-gather and reduce-scatter, issued as torch issues them but numbered for the hang watchdog.

A sharded run's collectives are FSDP2's, not the engine's: without these, a rank stuck in a unit's
all-gather would leave a hang report with nothing to name. Each call is stamped by runtime/progress.py
(the same sequence numbers the watchdog compares across ranks: the rank that never issued the collective
its peers wait in is the culprit) and a synchronous one is waited on through runtime/waits.py. The
payload is counted, inside the shard group and between groups apart (summary.json's comm_bytes_in_group
and comm_bytes): FSDP2's HSDP all-reduces each reduce-scattered shard across the replica groups itself, with
no way to replace it, but calls a hook on its output after it (`CountAllReduce`), where it is counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import tracked, wait_watching_membership
from lockstep.torch_private import FSDPAllGather, FSDPReduceScatter


class CommBytes:
    """The payload a run's FSDP collectives have sent, in bytes (shared by a model's comms): inside the shard
    group (`total`), and between the replica groups (`between`: FSDP2's HSDP all-reduces)."""

    def __init__(self) -> None:
        self.total = 0
        self.between = 0


class CountAllReduce:
    """FSDP2's all-reduce hook on a unit of an HSDP mesh (`set_all_reduce_hook`): called with the all-reduce's
    output after FSDP2 all-reduced a gradient shard across the replica groups, and only then (a backward
    under no_sync() all-reduces nothing); its payload is what crossed between the groups."""

    def __init__(self, sent: CommBytes) -> None:
        self.sent = sent

    def __call__(self, reduced: torch.Tensor) -> None:
        self.sent.between += reduced.numel() * reduced.element_size()


class PlainBuffers:
    """What FSDP2 asks of every comm besides the call: its buffers, plain tensors (FSDP2's own default)."""

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _Tracked(PlainBuffers):
    """A unit's collective, named for the watchdog and counted."""

    kind = ""

    def __init__(self, unit: str, sent: CommBytes) -> None:
        self.op, self.sent = f"{self.kind} (FSDP unit {unit})", sent

    def run(self, start: Any, payload: torch.Tensor, group: dist.ProcessGroup) -> None:
        """`start()` issues the collective asynchronously; it is waited on here, tracked."""
        self.sent.total += payload.numel() * payload.element_size()
        with tracked(self.op, (payload,), group):
            wait_watching_membership(start())


class TrackedAllGather(_Tracked, FSDPAllGather):
    """One unit's all-gather of its parameters (before its forward, and its backward if resharded)."""

    kind = "all_gather"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        def start() -> Any:
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)

        if async_op:  # FSDP2 waits on it (a prefetch): the record's work lets the watchdog poll it
            self.sent.total += input_tensor.numel() * input_tensor.element_size()
            record = PROGRESS.issue(self.op, (input_tensor,), group)
            record.work = start()
            return record.work
        self.run(start, input_tensor, group)
        return None


class TrackedReduceScatter(_Tracked, FSDPReduceScatter):
    """One unit's reduce-scatter of its gradients (after its backward), with FSDP2's op."""

    kind = "reduce_scatter"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        self.run(
            lambda: dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, op=op, group=group, async_op=True
            ),
            input_tensor,
            group,
        )
