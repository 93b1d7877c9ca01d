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

import torch
import torch.distributed as dist

from lockstep.runtime.watchdog import tracked

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
        self.large = [p.numel() >= LARGE_ELEMENTS for p in self.params]
        self._small = [i for i in range(self._n) if not self.large[i]]
        self.active = False
        self.num_micro_batches = 1
        self._reset()

    def _reset(self) -> None:
        self._acc: list[torch.Tensor | None] = [None] * self._n  # large parameters' accumulators
        self._small_acc: torch.Tensor | None = None  # the small ones', flat, in self._small order
        self._mult: list[float] | None = None  # 2**s_i, once the scale is known
        self._small_mult: torch.Tensor | None = None  # the same, per element of the small ones
        self._wide = False  # some small parameter's 2**s is beyond float32
        self._limit: torch.Tensor | None = None  # 2**(e_i + H): a micro-batch at or above it overflows
        self._largest: list[torch.Tensor | None] = [None] * self._n  # this micro-batch's max |g| per param
        self._maxima = torch.zeros(self._n, dtype=torch.float32, device=self.device)
        self._flags = torch.zeros(
            3, self._n, dtype=torch.float64, device=self.device
        )  # used, over, nonfinite
        self._held: list[torch.Tensor | None] = [None] * self._n

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
        maxima = torch.zeros(self._n, dtype=torch.float32, device=self.device)
        if self.rank == 0:
            present = [i for i, p in enumerate(self.params) if p.grad is not None]
            if present:
                norms = torch._foreach_norm([self.params[i].grad.detach() for i in present], float("inf"))  # type: ignore[union-attr]
                maxima[present] = torch.stack([n.float() for n in norms]).to(self.device)
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
            small = [self.params[i] for i in self._small]
            self._wide = any(abs(shifts[i]) > _FLOAT32_SHIFT for i in self._small)
            device = small[0].device
            per_param = torch.tensor(
                [self._mult[i] for i in self._small],
                dtype=torch.float64 if self._wide else torch.float32,
                device=device,
            )
            sizes = torch.tensor([p.numel() for p in small], device=device)
            self._small_mult = per_param.repeat_interleave(sizes)

    # ---- take ------------------------------------------------------------------------------------------

    def post_accumulate_grad(self, i: int, _param: torch.Tensor | None = None) -> None:
        """The per-parameter hook: a large gradient goes into its accumulator now, once the scale is known."""
        if self.active and self._mult is not None and self.large[i]:
            self._take_large(i)

    @torch.no_grad()
    def _take_large(self, i: int) -> None:
        p = self.params[i]
        grad = p.grad
        if grad is None:
            return
        p.grad = None
        assert self._mult is not None
        shift = self._mult[i]
        grad = grad.detach()
        largest = torch.linalg.vector_norm(grad, float("inf"))
        self._largest[i] = largest if self._largest[i] is None else torch.maximum(self._largest[i], largest)  # type: ignore[arg-type]
        acc = self._acc[i]
        if acc is None:
            acc = self._acc[i] = torch.zeros(grad.shape, dtype=torch.float64, device=grad.device)
        acc.add_(on_grid(grad, shift, wide=abs(math.log2(shift)) > _FLOAT32_SHIFT))

    @torch.no_grad()
    def end_micro_batch(self) -> None:
        """After each local micro-batch's backward: set the scale (first one), take what is left, fold flags."""
        if self._mult is None:
            self._agree_scale()
            for i in range(self._n):
                if self.large[i]:
                    self._take_large(i)
        self._take_small()
        used = torch.tensor([x is not None for x in self._largest], dtype=torch.bool, device=self.device)
        if bool(used.any()):
            largest = torch.zeros(self._n, dtype=torch.float32, device=self.device)
            present = [i for i in range(self._n) if self._largest[i] is not None]
            largest[present] = torch.stack([self._largest[i].float() for i in present]).to(self.device)  # type: ignore[union-attr]
            assert self._limit is not None
            self._flags[0] += used.double()
            self._flags[1] += (largest.double() >= self._limit).double()
            self._flags[2] += (~torch.isfinite(largest)).double()
            self._maxima = torch.maximum(self._maxima, largest)
        self._largest = [None] * self._n

    def _take_small(self) -> None:
        if not self._small:
            return
        grads = [self.params[i].grad for i in self._small]
        present = [k for k, g in enumerate(grads) if g is not None]
        if not present:
            return
        norms = torch._foreach_norm([grads[k].detach() for k in present], float("inf"))  # type: ignore[union-attr]
        for k, norm in zip(present, norms):
            self._largest[self._small[k]] = norm
        flat = torch.cat(
            [
                g.detach().reshape(-1)
                if g is not None
                else torch.zeros(self.params[i].numel(), device=self.params[i].device)
                for i, g in zip(self._small, grads)
            ]
        )
        for i in self._small:
            self.params[i].grad = None
        if self._small_acc is None:
            self._small_acc = torch.zeros(flat.numel(), dtype=torch.float64, device=flat.device)
        self._small_acc.add_(on_grid(flat, self._small_mult, wide=self._wide))  # type: ignore[arg-type]

    # ---- reduce ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce(self) -> torch.Tensor | None:
        """Sum every rank's accumulators and write the averages into `.grad`.

        Returns None when the step is done, or (on every rank alike) the agreed per-parameter maxima when
        a micro-batch overflowed its scale: then nothing was written and the caller redoes the step.
        """
        if self._mult is None:  # this rank had no micro-batch: it still takes part in the scale broadcast
            self._agree_scale()
        flags = self._flags
        if self.world > 1:
            with tracked("allreduce (gradient flags)", (flags,), self.group):
                dist.all_reduce(flags, group=self.group)
        finite = flags[2] == 0
        if bool(((flags[1] > 0) & finite).any()):
            return self._agreed_maxima()
        used = (flags[0] > 0).tolist()
        if self._small:
            self._reduce_small(used)
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

    def _reduce_small(self, used: list[bool]) -> None:
        small = [self.params[i] for i in self._small]
        flat = self._small_acc
        if flat is None:
            flat = torch.zeros(sum(p.numel() for p in small), dtype=torch.float64, device=small[0].device)
        self._small_acc = None
        self._all_reduce(flat, "allreduce (exact gradients, small parameters)")
        self._write_back(self._small, flat, used)

    def _large_buckets(self, used: list[bool]) -> list[list[int]]:
        """Used large parameters in order, in groups of about BUCKET_ELEMENTS (the same on every rank)."""
        buckets: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(self.params):
            if not (self.large[i] and used[i]):
                continue
            if size and size + p.numel() > BUCKET_ELEMENTS:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += p.numel()
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
        self._write_back(indices, flat, [True] * self._n)

    def _all_reduce(self, flat: torch.Tensor, op: str) -> None:
        if self.world > 1:
            wire = flat.to(self.device)
            with tracked(op, (wire,), self.group):
                dist.all_reduce(wire, group=self.group)
            if wire is not flat:
                flat.copy_(wire)

    def _write_back(self, indices: list[int], flat: torch.Tensor, used: list[bool]) -> None:
        """grad = sum * 2**-s / K in the parameter's dtype (float64 arithmetic: the same bits everywhere)."""
        assert self._mult is not None
        offset = 0
        for i in indices:
            p = self.params[i]
            total = flat[offset : offset + p.numel()]
            offset += p.numel()
            if used[i]:
                p.grad = total.mul(1.0 / self._mult[i]).div_(self.num_micro_batches).to(p.dtype).view_as(p)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank
