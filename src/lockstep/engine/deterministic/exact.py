"""Exact, order-independent gradient sums for deterministic mode: fixed-point accumulation of micro-batches.

Design note. Floating-point addition is not associative, so the bits of a gradient average depend on
which rank summed which micro-batch in which order. Here every micro-batch's gradient is rounded to an
integer multiple of 2**-s (s per parameter, the same on every rank) and the integers are summed in
float64, which holds every integer below 2**53 exactly: any order, any tree, any world size gives the
same sum (fixed_point.py has the arithmetic). The phases of one step, as the code below names them:

- begin: gradients a program left in `.grad` are held aside and added back at the end.
- scale: the scale of parameter i comes from micro-batch 0 (always on rank 0): s_i = 53 - H - ceil(log2 K)
  - e_i, where max|g_i| < 2**e_i in micro-batch 0 and H = HEADROOM_BITS. Any micro-batch whose largest
  element stays below 2**(e_i + H) then fits, with room for K of them. Rank 0 broadcasts micro-batch 0's
  per-parameter maxima after its first backward, asynchronously: every rank goes on with its next
  micro-batch meanwhile, holding its first micro-batch's gradients unrounded (no mid-step wait for rank 0).
- take: a large gradient is rounded onto the grid and added to its accumulator in its post-accumulate-grad
  hook, while it is hot, and its `.grad` is freed at once; the first micro-batch's gradient of the same
  parameter, if still held, is rounded in the same pass. Accumulators are views of persistent float64
  buckets (allocating 100 MB afresh each step costs more in page faults than the arithmetic). The small
  gradients are views of one flat buffer that autograd accumulates into: at the end of each micro-batch
  they are taken in a handful of whole-vector operations (a model of hundreds of tiny layers would
  otherwise pay a few kernel launches and Python calls per parameter). A micro-batch above the headroom
  marks its parameter as overflowed (the step will be redone).
- reduce: during the rank's last micro-batch, each bucket's all-reduce starts as soon as its gradients are
  all taken (in bucket order, the same on every rank), overlapping the rest of the backward; the small
  sums follow, with the flags (used, overflowed, non-finite). `.grad` becomes sum * 2**-s / K, in the
  parameter's dtype, written into the last micro-batch's own gradient buffers where it can.
- redo: when any rank overflowed, every rank learns it from the flags; the ranks agree on the true
  maxima (an all-reduce MAX, exact) and the caller runs the step's micro-batches again at that scale
  (H = 0), which cannot overflow. Rare: a gradient 4096x larger than micro-batch 0's in the same step.

Precision: about 53 - 12 - log2(K) bits below micro-batch 0's largest element of each parameter (35
bits for K = 64), far below float32's own rounding of the result for every element within 2**-11 of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.deterministic.exact_buckets import ExactBucket, ExactBuckets, known
from lockstep.engine.deterministic.fixed_point import (
    HEADROOM_BITS,
    largest_magnitude,
    overflow_limits,
    powers_of_two,
    scale_exponents,
)
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import tracked, wait_tracked, wait_watching_membership

LARGE_ELEMENTS = 65536  # a gradient this large is taken in its hook; smaller ones at the micro-batch's end
BUCKET_ELEMENTS = 4 * 1024 * 1024  # float64 elements per all-reduce of large accumulators (32 MiB)


@dataclass
class _Pending:
    """A rank's first micro-batch, held unrounded while the scale broadcast is in flight."""

    maxima: torch.Tensor
    used: bytearray
    large: dict[int, torch.Tensor]
    small: torch.Tensor | None


class ExactReducer:
    """Fixed-point sums for one replica's trainable parameters: the phases of the module's design note over
    the accumulators it holds (`accumulators`, an ExactBuckets: exact_buckets.py)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        self.params, self.names, self.group = list(params), list(names), group
        self.rank, self.world, self.device = rank, world_size, device
        self._n = len(self.params)
        self.accumulators = ExactBuckets(
            params,
            group,
            world_size=world_size,
            device=device,
            large_elements=LARGE_ELEMENTS,
            bucket_elements=BUCKET_ELEMENTS,
        )
        self.large, self.small = self.accumulators.large, self.accumulators.small  # fixed at construction
        # one all-reduce carries the small parameters' sums, then the flags
        self._flag_buffer = torch.zeros(self.small.size + 3 * self._n, dtype=torch.float64, device=device)
        self._small_sums = self._flag_buffer[: self.small.size]
        self.active = False
        self.num_micro_batches = 1
        self._reset()

    # ---- begin -------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._mult: dict[int, float] | None = None  # 2**s_i of the large parameters, once known
        self._factor: dict[int, float] = {}  # their 2**-s_i / K
        self._limit: torch.Tensor | None = None  # per parameter: a micro-batch at or above it overflows
        self._small_mult: torch.Tensor | None = None  # 2**s of the small ones, in their flat order
        self._small_factor: torch.Tensor | None = None  # their 2**-s / K
        self._maxima = torch.zeros(self._n, dtype=torch.float64, device=self.device)
        self._flags = self._flag_buffer[self.small.size :].view(3, self._n)  # used, over, nonfinite
        self._flag_buffer.zero_()
        self._spare: list[torch.Tensor | None] = [None] * self._n  # last micro-batch's grads, reused
        self._held: list[torch.Tensor | None] = [None] * self._n
        self._last = False
        self._agreement: tuple[torch.Tensor, Any] | None = None  # the scale broadcast in flight
        self._pending: _Pending | None = None  # the first micro-batch's gradients, until the scale is known
        self._waiting: dict[int, torch.Tensor] = {}  # its large ones, once the scale is known
        self.accumulators.reset()
        self._start_micro_batch()

    @property
    def buckets(self) -> list[ExactBucket]:
        return self.accumulators.buckets

    @property
    def launched_in_backward(self) -> int:
        return self.accumulators.launched_in_backward

    @property
    def bytes_sent(self) -> int:
        return self.accumulators.bytes_sent

    def _start_micro_batch(self) -> None:
        self._mb_max = torch.zeros(self._n, dtype=torch.float64, device=self.device)  # max |g| per parameter
        self._mb_used = bytearray(self._n)

    def begin(self, num_micro_batches: int, maxima: torch.Tensor | None = None) -> None:
        """Start a step of `num_micro_batches`; `maxima` (a redo): the step's agreed per-parameter maxima."""
        self._reset()
        self.num_micro_batches, self.active = num_micro_batches, True
        self.small.begin()
        for i in range(self._n):
            if self.large[i]:
                p = self.params[i]
                self._held[i], p.grad = p.grad, None
        if maxima is not None:
            self._set_scale(maxima, headroom=0)

    def start_micro_batch(self, *, last: bool) -> None:
        """Before each local micro-batch: `last` says it is this rank's last of the step (buckets launch)."""
        self._last = last

    # ---- scale -------------------------------------------------------------------------------------------

    def _start_agreement(self) -> None:
        """After the first local micro-batch (or none): rank 0's micro-batch 0 will set everyone's scale.
        The broadcast runs while the rank goes on with its next micro-batch; _agree() waits for it."""
        maxima = self._mb_max.clone() if self.rank == 0 else torch.zeros_like(self._mb_max)
        record = None
        if self.world > 1:
            record = PROGRESS.issue("broadcast (gradient scale)", (maxima,), self.group)
            record.work = dist.broadcast(maxima, src=self._global(0), group=self.group, async_op=True)
        self._agreement = (maxima, record)

    def _agree(self) -> None:
        """Wait for the scale (starting the broadcast on a rank without micro-batches), then take what the
        first micro-batch left pending."""
        if self._agreement is None:
            self._start_agreement()
        maxima, record = known(self._agreement, "the scale broadcast")
        if record is not None:
            wait_tracked(record, record.work)
        self._agreement = None
        self._set_scale(maxima, headroom=HEADROOM_BITS)
        self._take_pending()

    def _set_scale(self, maxima: torch.Tensor, *, headroom: int) -> None:
        k = self.num_micro_batches
        shifts = scale_exponents(maxima, k, headroom)
        mult, factor = powers_of_two(shifts), powers_of_two(-shifts).mul_(1.0 / k)  # 2**s; 2**-s / K
        self._limit = overflow_limits(shifts, k)
        large = self.accumulators.large_index
        self._mult = dict(zip(large.tolist(), mult[large].tolist()))
        self._factor = dict(zip(large.tolist(), factor[large].tolist()))
        self._small_mult, self._small_factor = mult[self.small.index], factor[self.small.index]

    # ---- take --------------------------------------------------------------------------------------------

    def post_accumulate_grad(self, i: int, _param: torch.Tensor | None = None) -> None:
        """The per-parameter hook: note the use; a large gradient is taken now once the scale is known."""
        if not self.active:
            return
        self._mb_used[i] = 1
        if self.large[i]:
            if self._mult is None and self._agreement is not None:
                self._agree()  # the first micro-batch's scale: by now rank 0 has long sent it
            if self._mult is not None:
                self._take_large(i)

    @torch.no_grad()
    def _take_large(self, i: int) -> None:
        p = self.params[i]
        grad = p.grad
        if grad is None:
            return
        p.grad = None
        mult = known(self._mult, "the multipliers")[i]
        earlier = self._waiting.pop(i, None)  # the first micro-batch's, rounded in the same pass
        grads = [grad] if earlier is None else [earlier, grad]
        largest = self.accumulators.add(i, grads, mult)
        self._mb_max[i] = torch.maximum(self._mb_max[i], largest.to(self.device))
        if self._last:
            self._spare[i] = grad  # its buffer will hold the averaged gradient
            self.accumulators.taken(i)

    @torch.no_grad()
    def end_micro_batch(self) -> None:
        """After each local micro-batch's backward: take what is left, fold flags; after the first one, start
        agreeing on the scale (and wait for it only if this was the rank's last micro-batch)."""
        small_used = self._take_small_maxima()
        if self._mult is None and self._agreement is None:
            self._measure_large_in_grad()
            self._start_agreement()
            if not self._last:
                self._stash(small_used)
                return
        if self._mult is None:
            self._agree()
            for i in range(self._n):  # this micro-batch's large gradients that no hook could take yet
                if self.large[i]:
                    self._take_large(i)
        if small_used:
            multipliers = known(self._small_mult, "the small multipliers")
            self.small.add_on_grid(self._small_sums, multipliers)
        self._fold_flags(self._mb_max, self._mb_used)
        self._take_waiting()
        if self._last:
            self.accumulators.launch_all()
        self._start_micro_batch()

    def _measure_large_in_grad(self) -> None:
        for i in range(self._n):
            grad = self.params[i].grad
            if self.large[i] and grad is not None:
                self._mb_max[i] = largest_magnitude(grad).to(self.device)

    def _stash(self, small_used: bool) -> None:
        """The first micro-batch's gradients wait, unrounded, for the scale; the next one starts afresh."""
        large = {}
        for i in range(self._n):
            grad = self.params[i].grad
            if self.large[i] and grad is not None:
                large[i], self.params[i].grad = grad, None
        small = self.small.grads.clone() if small_used else None
        self.small.grads.zero_()
        self._pending = _Pending(self._mb_max, self._mb_used, large, small)
        self._start_micro_batch()

    @torch.no_grad()
    def _take_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._waiting = pending.large  # taken with the same parameter's next gradient (or at the end)
        if pending.small is not None:
            multipliers = known(self._small_mult, "the small multipliers")
            self.small.add_on_grid(self._small_sums, multipliers, source=pending.small)
        self._fold_flags(pending.maxima, pending.used)

    def _take_small_maxima(self) -> bool:
        """The small gradients' maxima of this micro-batch, noted; False if none of them got a gradient."""
        if not self.small.params:
            return False
        self.small.reattach()
        if not any(self._mb_used[i] for i in self.small.indices):
            return False
        self._mb_max[self.small.index] = self.small.maxima().to(self.device)
        return True

    def _fold_flags(self, largest: torch.Tensor, used_bytes: bytearray) -> None:
        limit = known(self._limit, "the overflow limits")
        used = torch.frombuffer(used_bytes, dtype=torch.uint8).to(self.device, torch.float64)
        self._flags[0] += used
        self._flags[1] += (largest >= limit).double() * used
        self._flags[2] += (~torch.isfinite(largest)).double()
        self._maxima = torch.maximum(self._maxima, largest)

    # ---- reduce ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce(self) -> torch.Tensor | None:
        """Sum every rank's accumulators and write the averages into `.grad`.

        Returns None when the step is done, or (on every rank alike) the agreed per-parameter maxima when
        a micro-batch overflowed its scale: then nothing was written and the caller redoes the step.
        """
        if self._mult is None:  # this rank had no micro-batch: it still takes part in the scale broadcast
            self._agree()
        self.accumulators.launch_all()
        if self.world > 1:
            with tracked(
                "allreduce (exact gradients: flags and small parameters)", (self._flag_buffer,), self.group
            ):
                wait_watching_membership(dist.all_reduce(self._flag_buffer, group=self.group, async_op=True))
        flags = self._flags
        finite = flags[2] == 0
        if bool(((flags[1] > 0) & finite).any()):
            return self._agreed_maxima()
        used = (flags[0] > 0).tolist()
        nonfinite = (~finite).tolist()
        if self.small.params:
            factors = known(self._small_factor, "the small parameters' factors")
            keep = [used[i] for i in self.small.indices]
            nan = [used[i] and nonfinite[i] for i in self.small.indices]
            self.small.write(self._small_sums, factors, keep, nan)
        for b in self.accumulators.buckets:
            self.accumulators.write(b, used, self._spare, self._factor)
        for i in range(self._n):
            p = self.params[i]
            if self.large[i] and nonfinite[i] and used[i]:
                p.grad = torch.full_like(p, float("nan"))
            held = self._held[i]
            if held is not None:
                p.grad = held if p.grad is None else held.add_(p.grad)
        self._finish()
        return None

    def _take_waiting(self) -> None:
        """The first micro-batch's large gradients whose parameters the next one did not use."""
        mult = known(self._mult, "the multipliers")
        for i, grad in self._waiting.items():
            self.accumulators.add(i, [grad], mult[i])
        self._waiting = {}

    def _finish(self) -> None:
        self.active = False
        self._spare, self._held, self._waiting = [None] * self._n, [None] * self._n, {}

    def _agreed_maxima(self) -> torch.Tensor:
        for (
            b
        ) in self.accumulators.buckets:  # every rank waits for what it launched before the next collective
            self.accumulators.wait(b)
        maxima = self._maxima.clone()
        if self.world > 1:
            with tracked("allreduce max (gradient maxima)", (maxima,), self.group):
                wait_watching_membership(
                    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
                )
        for i, p in enumerate(self.params):  # back as the step found them, for the redo
            if self.large[i]:
                p.grad = self._held[i]
        self.small.restore()
        self._finish()
        return maxima

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank
