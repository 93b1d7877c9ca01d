"""Exact, order-independent gradient sums for deterministic mode: fixed-point accumulation of micro-batches.

Design note. Floating-point addition is not associative, so the bits of a gradient average depend on
which rank summed which micro-batch in which order. Here every micro-batch's gradient is rounded to an
integer multiple of 2**-s (s per parameter, the same on every rank) and the integers are summed in
float64, which holds every integer below 2**53 exactly: any order, any tree, any world size gives the
same sum. The phases of one step, as the code below names them:

- begin: zeroed accumulators; gradients a program left in `.grad` are held aside and added back at the end.
- scale: the scale of parameter i comes from micro-batch 0 (always on rank 0): s_i = 53 - H - ceil(log2 K)
  - e_i, where max|g_i| < 2**e_i in micro-batch 0 and H = HEADROOM_BITS. Any micro-batch whose largest
  element stays below 2**(e_i + H) then fits, with room for K of them. Rank 0 broadcasts micro-batch 0's
  per-parameter maxima after its first backward; until then the other ranks keep their first gradients.
- take: a large gradient is rounded onto the grid and added to its accumulator in its post-accumulate-grad
  hook, while it is hot, and its `.grad` is freed at once (peak memory: one float64 accumulator per
  parameter, not that plus a float32 gradient); the small ones are taken together at the end of each
  micro-batch, in a handful of whole-vector operations (a model of hundreds of tiny layers would otherwise
  pay a few kernel launches per parameter). A micro-batch above the headroom marks its parameter as
  overflowed (the step will be redone).
- reduce: the accumulators go through all-reduces in buckets (with the flags: used, overflowed,
  non-finite), and `.grad` becomes sum * 2**-s / K, in the parameter's dtype.
- redo: when any rank overflowed, every rank learns it from the flags; the ranks agree on the true
  maxima (an all-reduce MAX, exact) and the caller runs the step's micro-batches again at that scale
  (H = 0), which cannot overflow. Rare: a gradient 4096x larger than micro-batch 0's in the same step.

Precision: about 53 - 12 - log2(K) bits below micro-batch 0's largest element of each parameter (35
bits for K = 64), far below float32's own rounding of the result for every element within 2**-11 of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from lockstep.errors import InternalError
from lockstep.runtime.watchdog import tracked

T = TypeVar("T")


def _known(value: T | None, what: str) -> T:
    """`value`, which the step's order of phases guarantees is set; an InternalError if a phase was skipped."""
    if value is None:
        raise InternalError(f"exact reduction: {what} used before the scale was agreed (a phase was skipped)")
    return value


HEADROOM_BITS = 12  # a micro-batch's gradient may be up to 2**12 times micro-batch 0's before a redo
EXACT_BITS = 53  # float64 represents every integer of magnitude <= 2**53
LARGE_ELEMENTS = 65536  # a gradient this large is taken in its hook; smaller ones at the micro-batch's end
BUCKET_ELEMENTS = 4 * 1024 * 1024  # float64 elements per all-reduce of large accumulators (32 MiB)
_MAX_SHIFT = 1000  # |s| stays inside float64's exponent range
_FLOAT32_SHIFT = 126  # 2**s is a normal float32 for |s| <= 126: the product can stay in float32


def scale_exponents(maxima: torch.Tensor, num_micro_batches: int, headroom: int) -> list[int]:
    """s_i per parameter from the largest |gradient| of each (a 1-D float tensor): pure arithmetic.

    A maximum of zero or a non-finite one says nothing about the magnitude: such a parameter borrows the
    largest exponent of the others (a redo follows only if its gradients turn out larger than that).
    """
    finite = torch.isfinite(maxima) & (maxima > 0)
    exponents = torch.frexp(maxima.double()).exponent.to(torch.int64)  # maxima < 2**exponent
    fallback = int(exponents[finite].max()) if bool(finite.any()) else 0
    exponents = torch.where(finite, exponents, fallback)
    top = EXACT_BITS - headroom - _sum_bits(num_micro_batches)
    return [max(-_MAX_SHIFT, min(_MAX_SHIFT, top - int(e))) for e in exponents.tolist()]


def _sum_bits(num_micro_batches: int) -> int:
    """Bits a sum of K values needs beyond one of them."""
    return max(math.ceil(math.log2(max(num_micro_batches, 1))), 0)


def on_grid(grad: torch.Tensor, shift: torch.Tensor | float, *, wide: bool) -> torch.Tensor:
    """round(grad * 2**shift): exact (a power of two), in float32 unless `wide` (float64: |shift| > 126)."""
    values = grad.double() if wide or grad.dtype == torch.float64 else grad.float()
    return torch.round(values * shift)


class ExactReducer:
    """Fixed-point accumulators for one replica's trainable parameters (see the module's design note)."""

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
        # "Small" parameters are taken together as one flat vector: they must share a device and a dtype.
        first_small = next((p for p in self.params if p.numel() < LARGE_ELEMENTS), None)
        self.large = [
            p.numel() >= LARGE_ELEMENTS
            or first_small is None
            or (p.device, p.dtype) != (first_small.device, first_small.dtype)
            for p in self.params
        ]
        self._small = [i for i in range(self._n) if not self.large[i]]
        self._large = [i for i in range(self._n) if self.large[i]]
        sizes = [self.params[i].numel() for i in self._small]
        self._small_size = sum(sizes)
        self._offsets = [0]
        for size in sizes:
            self._offsets.append(self._offsets[-1] + size)
        small_device = first_small.device if first_small is not None else device
        self._segments = torch.repeat_interleave(
            torch.arange(len(sizes), device=small_device),
            torch.tensor(sizes, dtype=torch.long, device=small_device),
        )
        self._small_index = torch.tensor(self._small, dtype=torch.long, device=device)
        self.active = False
        self.num_micro_batches = 1
        self._reset()

    def _reset(self) -> None:
        self._acc: list[torch.Tensor | None] = [None] * self._n  # large parameters' accumulators
        self._small_acc: torch.Tensor | None = None  # the small ones', flat, in self._small order
        self._mult: list[float] | None = None  # 2**s_i, once the scale is known
        self._small_mult: torch.Tensor | None = None  # 2**s per element of the small ones
        self._small_inverse: torch.Tensor | None = None  # 2**-s per element, float64
        self._wide = False  # some small parameter's 2**s is beyond float32
        self._limit: torch.Tensor | None = None  # 2**(e_i + H): a micro-batch at or above it overflows
        self._maxima = torch.zeros(self._n, dtype=torch.float32, device=self.device)
        self._flags = torch.zeros(
            3, self._n, dtype=torch.float64, device=self.device
        )  # used, over, nonfinite
        self._held: list[torch.Tensor | None] = [None] * self._n
        self._start_micro_batch()

    def _start_micro_batch(self) -> None:
        self._mb_max = torch.zeros(self._n, dtype=torch.float32, device=self.device)  # max |g| per parameter
        self._mb_used = bytearray(self._n)

    # ---- begin -----------------------------------------------------------------------------------------

    def begin(self, num_micro_batches: int, maxima: torch.Tensor | None = None) -> None:
        """Start a step of `num_micro_batches`; `maxima` (a redo): the step's agreed per-parameter maxima."""
        self._reset()
        self.num_micro_batches, self.active = num_micro_batches, True
        for i, p in enumerate(self.params):
            self._held[i], p.grad = p.grad, None
        if maxima is not None:
            self._set_scale(maxima, headroom=0)

    # ---- scale -----------------------------------------------------------------------------------------

    def _agree_scale(self) -> None:
        """After the first local micro-batch (or none): rank 0's micro-batch 0 sets everyone's scale."""
        maxima = self._mb_max.clone() if self.rank == 0 else torch.zeros_like(self._mb_max)
        if self.world > 1:
            with tracked("broadcast (gradient scale)", (maxima,), self.group):
                dist.broadcast(maxima, src=self._global(0), group=self.group)
        self._set_scale(maxima, headroom=HEADROOM_BITS)

    def _set_scale(self, maxima: torch.Tensor, *, headroom: int) -> None:
        shifts = scale_exponents(maxima.cpu(), self.num_micro_batches, headroom)
        self._mult = [math.ldexp(1.0, s) for s in shifts]
        top = EXACT_BITS - _sum_bits(self.num_micro_batches)
        self._limit = torch.tensor(
            [math.ldexp(1.0, min(top - s, _MAX_SHIFT)) for s in shifts],
            dtype=torch.float64,
            device=self.device,
        )
        if self._small:
            device = self._segments.device
            self._wide = any(abs(shifts[i]) > _FLOAT32_SHIFT for i in self._small)
            exponents = torch.tensor([shifts[i] for i in self._small], dtype=torch.float64, device=device)
            per_element = exponents[self._segments]
            self._small_mult = torch.exp2(per_element).to(torch.float64 if self._wide else torch.float32)
            self._small_inverse = torch.exp2(-per_element)

    # ---- take ------------------------------------------------------------------------------------------

    def post_accumulate_grad(self, i: int, _param: torch.Tensor | None = None) -> None:
        """The per-parameter hook: a large gradient goes into its accumulator now, once the scale is known."""
        if self.active and self._mult is not None and self.large[i]:
            self._take_large(i)

    @torch.no_grad()
    def _take_large(self, i: int) -> None:
        grad = self.params[i].grad
        if grad is None:
            return
        self._measure_large(i, grad)
        self._quantize_large(i)

    def _measure_large(self, i: int, grad: torch.Tensor) -> None:
        largest = torch.linalg.vector_norm(grad.detach(), float("inf")).to(self.device, torch.float32)
        self._mb_max[i] = torch.maximum(self._mb_max[i], largest)
        self._mb_used[i] = 1

    def _quantize_large(self, i: int) -> None:
        p = self.params[i]
        grad = p.grad
        if grad is None:
            return
        p.grad = None
        shift = _known(self._mult, "the multipliers")[i]
        acc = self._acc[i]
        if acc is None:
            acc = self._acc[i] = torch.zeros(grad.shape, dtype=torch.float64, device=grad.device)
        acc.add_(on_grid(grad.detach(), shift, wide=abs(math.log2(shift)) > _FLOAT32_SHIFT))

    @torch.no_grad()
    def end_micro_batch(self) -> None:
        """After each local micro-batch's backward: set the scale (first one), take what is left, fold flags."""
        flat = self._measure_small()
        if self._mult is None:
            for i in self._large:
                grad = self.params[i].grad
                if grad is not None:
                    self._measure_large(i, grad)
            self._agree_scale()
            for i in self._large:
                self._quantize_large(i)
        if flat is not None:
            self._quantize_small(flat)
        limit = _known(self._limit, "the overflow limits")
        used = torch.tensor(list(self._mb_used), dtype=torch.float64, device=self.device)
        largest = self._mb_max
        self._flags[0] += used
        self._flags[1] += (largest.double() >= limit).double() * used
        self._flags[2] += (~torch.isfinite(largest)).double()
        self._maxima = torch.maximum(self._maxima, largest)
        self._start_micro_batch()

    def _measure_small(self) -> torch.Tensor | None:
        """The small gradients as one flat vector (freed from `.grad`), their maxima noted; None if none."""
        if not self._small:
            return None
        grads = [self.params[i].grad for i in self._small]
        if all(g is None for g in grads):
            return None
        flat = torch.cat(
            [
                g.detach().reshape(-1)
                if g is not None
                else torch.zeros(self.params[i].numel(), device=self._segments.device)
                for i, g in zip(self._small, grads)
            ]
        )
        for i, g in zip(self._small, grads):
            self.params[i].grad = None
            if g is not None:
                self._mb_used[i] = 1
        maxima = torch.zeros(len(self._small), dtype=flat.dtype, device=flat.device)
        maxima.scatter_reduce_(0, self._segments, flat.abs(), "amax")
        self._mb_max[self._small_index] = maxima.to(self.device, torch.float32)
        return flat

    def _quantize_small(self, flat: torch.Tensor) -> None:
        if self._small_acc is None:
            self._small_acc = torch.zeros(flat.numel(), dtype=torch.float64, device=flat.device)
        self._small_acc.add_(on_grid(flat, self._small_mult, wide=self._wide))  # type: ignore[arg-type]

    # ---- reduce ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce(self) -> torch.Tensor | None:
        """Sum every rank's accumulators and write the averages into `.grad`.

        Returns None when the step is done, or (on every rank alike) the agreed per-parameter maxima when
        a micro-batch overflowed its scale: then nothing was written and the caller redoes the step.
        The flags ride in the first all-reduce, with the small parameters' sums: when a rank overflowed,
        those sums are dropped unread.
        """
        if self._mult is None:  # this rank had no micro-batch: it still takes part in the scale broadcast
            self._agree_scale()
        small = self._small_acc
        if small is None:
            small = torch.zeros(self._small_size, dtype=torch.float64, device=self._segments.device)
        first = torch.cat([small.to(self.device), self._flags.reshape(-1)])
        self._small_acc = None
        self._all_reduce(first, "allreduce (exact gradients: flags and small parameters)")
        flags = first[self._small_size :].reshape(3, self._n)
        finite = flags[2] == 0
        if bool(((flags[1] > 0) & finite).any()):
            return self._agreed_maxima()
        used = (flags[0] > 0).tolist()
        if self._small:
            self._write_small(first[: self._small_size], used)
        for bucket in self._large_buckets(used):
            self._reduce_large(bucket)
        nonfinite = (~finite).tolist()
        for i, p in enumerate(self.params):
            if not used[i]:
                p.grad = None
            elif nonfinite[i]:
                p.grad = torch.full_like(p, float("nan"))
            held = self._held[i]
            if held is not None:
                p.grad = held if p.grad is None else held.add_(p.grad)
        self._finish()
        return None

    def _finish(self) -> None:
        self.active = False
        self._acc, self._small_acc, self._held = [None] * self._n, None, [None] * self._n

    def _agreed_maxima(self) -> torch.Tensor:
        maxima = self._maxima.clone()
        if self.world > 1:
            with tracked("allreduce max (gradient maxima)", (maxima,), self.group):
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        for i, p in enumerate(self.params):  # back as the step found them, for the redo
            p.grad = self._held[i]
        self._finish()
        return maxima

    def _write_small(self, total: torch.Tensor, used: list[bool]) -> None:
        """grad = sum * 2**-s / K for every small parameter in a few whole-vector operations (float64)."""
        inverse = _known(self._small_inverse, "the small parameters' inverse scale")
        dtype = self.params[self._small[0]].dtype
        means = total.to(inverse.device).mul_(inverse).div_(self.num_micro_batches)
        values = means.to(dtype)
        for position, i in enumerate(self._small):
            p = self.params[i]
            if used[i]:
                p.grad = values[self._offsets[position] : self._offsets[position + 1]].view_as(p)

    def _large_buckets(self, used: list[bool]) -> list[list[int]]:
        """Used large parameters in order, in groups of about BUCKET_ELEMENTS (the same on every rank)."""
        buckets: list[list[int]] = [[]]
        size = 0
        for i in self._large:
            if not used[i]:
                continue
            numel = self.params[i].numel()
            if size and size + numel > BUCKET_ELEMENTS:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += numel
        return [b for b in buckets if b]

    def _reduce_large(self, indices: list[int]) -> None:
        parts = []
        for i in indices:
            acc, p = self._acc[i], self.params[i]
            parts.append(
                acc.reshape(-1)
                if acc is not None
                else torch.zeros(p.numel(), dtype=torch.float64, device=p.device)
            )
            self._acc[i] = None  # the bucket holds it now: free the accumulator
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        del parts
        self._all_reduce(flat, "allreduce (exact gradient bucket)")
        mult = _known(self._mult, "the multipliers")
        offset = 0
        for i in indices:
            p = self.params[i]
            total = flat[offset : offset + p.numel()]
            offset += p.numel()
            p.grad = total.mul(1.0 / mult[i]).div_(self.num_micro_batches).to(p.dtype).view_as(p)

    def _all_reduce(self, flat: torch.Tensor, op: str) -> None:
        if self.world > 1:
            wire = flat.to(self.device)
            with tracked(op, (wire,), self.group):
                dist.all_reduce(wire, group=self.group)
            if wire is not flat:
                flat.copy_(wire)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank
