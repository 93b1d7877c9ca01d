"""Deterministic mode's accumulators: which gradients are large, their float64 buckets, their all-reduces.

Small gradients (below LARGE_ELEMENTS in exact.py, and sharing the first small parameter's device and
dtype) are views of one flat buffer that autograd accumulates into (small_grads.py), taken a few whole-
vector operations at a time. Every other parameter is large: its fixed-point sum lives in a float64
accumulator, a view of a bucket of about BUCKET_ELEMENTS elements (exact.py) that is allocated at first
use and kept for the replica's life (allocating 100 MB afresh each step costs more in page faults than
the arithmetic). The buckets hold the large parameters in reverse order, the order a backward usually
produces their gradients, and their all-reduces launch strictly in bucket order, the same on every rank.

`ExactBuckets` is a part that exact.py's ExactReducer holds (`ExactReducer.accumulators`): it owns the
accumulators (which parameters are large, the buckets, which accumulators hold this step's value) and
their arithmetic (the fixed-point Quantizer: a micro-batch added on the grid, the mean written back),
and launches and waits for the buckets' all-reduces. The reducer owns the step's phases and scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lockstep.engine.deterministic.fixed_point import Quantizer
from lockstep.engine.deterministic.small_grads import SmallGradients
from lockstep.errors import InternalError
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import wait_tracked

T = TypeVar("T")


def known(value: T | None, what: str) -> T:
    """`value`, which the step's order of phases guarantees is set; an InternalError if a phase was skipped."""
    if value is None:
        raise InternalError(f"exact reduction: {what} used before the scale was agreed (a phase was skipped)")
    return value


@dataclass
class ExactBucket:
    """Large parameters whose float64 accumulators share one buffer and one all-reduce."""

    indices: list[int]
    offsets: list[int]  # where each parameter's accumulator starts in the buffer
    numel: int
    buffer: torch.Tensor | None = None  # allocated on first use, kept for the replica's life
    taken: int = 0  # parameters taken during the rank's last micro-batch of the step
    record: Any = None  # the all-reduce in flight (its progress record carries the work)


class ExactBuckets:
    """The accumulators of one replica's trainable parameters and the all-reduces of their buckets."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None,
        *,
        world_size: int,
        device: torch.device,
        large_elements: int,
        bucket_elements: int,
    ) -> None:
        self.params, self.group = list(params), group
        self.world, self.device = world_size, device
        self._n = len(self.params)
        self._plan_small(large_elements)
        self._plan_buckets(bucket_elements)
        self._quantizer = Quantizer()
        self.launched_in_backward = 0  # buckets whose all-reduce started inside a backward (overlapped)
        self.bytes_sent = 0  # gradient payload handed to the all-reduces, over the replica's life
        self._written = bytearray(self._n)  # a large parameter's accumulator holds this step's value
        self._next_bucket = 0  # the next bucket to launch in this step

    def _plan_small(self, large_elements: int) -> None:
        """Small parameters (sharing the first one's device and dtype) get views of one flat grad buffer."""
        first = next((p for p in self.params if p.numel() < large_elements), None)
        self.large = [
            p.numel() >= large_elements or first is None or (p.device, p.dtype) != (first.device, first.dtype)
            for p in self.params
        ]
        self.small = SmallGradients(
            self.params, [i for i in range(self._n) if not self.large[i]], self.device
        )
        self.large_index = torch.tensor(
            [i for i in range(self._n) if self.large[i]], dtype=torch.long, device=self.device
        )

    def _plan_buckets(self, bucket_elements: int) -> None:
        """Large parameters in reverse order (the order a backward usually produces them), ~bucket_elements each."""
        self.buckets: list[ExactBucket] = []
        self._bucket_of = [-1] * self._n
        self._offset = [0] * self._n
        for i in reversed(range(self._n)):
            if not self.large[i]:
                continue
            numel = self.params[i].numel()
            if not self.buckets or (
                self.buckets[-1].numel and self.buckets[-1].numel + numel > bucket_elements
            ):
                self.buckets.append(ExactBucket([], [], 0))
            b = self.buckets[-1]
            self._bucket_of[i], self._offset[i] = len(self.buckets) - 1, b.numel
            b.indices.append(i)
            b.offsets.append(b.numel)
            b.numel += numel

    def reset(self) -> None:
        """A step begins: no accumulator holds its value, no bucket is launched."""
        self._written = bytearray(self._n)
        self._next_bucket = 0
        for b in self.buckets:
            b.taken, b.record = 0, None

    def _accumulator(self, i: int) -> torch.Tensor:
        b = self.buckets[self._bucket_of[i]]
        if b.buffer is None:
            b.buffer = torch.empty(b.numel, dtype=torch.float64, device=self.device)
        return b.buffer[self._offset[i] : self._offset[i] + self.params[i].numel()]

    def add(self, i: int, grads: list[torch.Tensor], mult: float) -> torch.Tensor:
        """Large parameter i's accumulator (+)= `grads` rounded onto the grid of `mult`; their largest |element|."""
        largest = self._quantizer.add(self._accumulator(i), grads, mult, first=not self._written[i])
        self._written[i] = 1
        return largest

    def taken(self, i: int) -> None:
        """In the rank's last micro-batch, large parameter i was taken: launch the buckets now complete."""
        self.buckets[self._bucket_of[i]].taken += 1
        self._launch_ready()

    def write(
        self, b: ExactBucket, used: list[bool], spare: list[torch.Tensor | None], factor: dict[int, float]
    ) -> None:
        """Wait for bucket b, then each used parameter's `.grad` = its sum * factor (into `spare` where it fits)."""
        self.wait(b)
        for i in b.indices:
            p = self.params[i]
            if not used[i]:
                p.grad = None
                continue
            out = spare[i]
            out = out if out is not None and out.shape == p.shape and out.dtype == p.dtype else None
            p.grad = self._quantizer.write_mean(
                out if out is not None else torch.empty_like(p), self._accumulator(i), factor[i]
            )

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose gradients were all taken in the last micro-batch."""
        while self._next_bucket < len(self.buckets):
            b = self.buckets[self._next_bucket]
            if b.taken < len(b.indices):
                return
            self._launch(b)
            self.launched_in_backward += 1

    def launch_all(self) -> None:
        while self._next_bucket < len(self.buckets):
            self._launch(self.buckets[self._next_bucket])

    def _launch(self, b: ExactBucket) -> None:
        for i in b.indices:
            if not self._written[i]:  # no local micro-batch used it: the rank adds zeros
                self._accumulator(i).zero_()
                self._written[i] = 1
        self._next_bucket += 1
        if self.world > 1:
            buffer = known(b.buffer, "a bucket's buffer")
            b.record = PROGRESS.issue("allreduce (exact gradient bucket)", (buffer,), self.group)
            self.bytes_sent += buffer.numel() * buffer.element_size()
            b.record.work = dist.all_reduce(buffer, group=self.group, async_op=True)

    def wait(self, b: ExactBucket) -> None:
        if b.record is not None:
            wait_tracked(b.record, b.record.work)
            b.record = None
