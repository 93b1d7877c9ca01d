"""Deterministic mode on sharded parameters: FSDP2's reduce-scatter made an exact fixed-point sum.

The replicated engine's exact sums (engine/deterministic/exact.py) put every micro-batch's gradient of
parameter i on a grid of 2**-s_i and sum the integers in float64, which no order of addition can change.
Here the same arithmetic runs inside FSDP2's reduce-scatter (`set_custom_reduce_scatter`, one comm per
FSDP unit), so a sharded run ends with the bits of a replicated one, at any layout:

- scale: s_i comes from micro-batch 0, which rank 0 always computes: in each unit's first reduce-scatter
  of the step, rank 0 measures max |g_i| of its (unsharded) input and broadcasts it to every rank; s_i is
  then exactly the replicated engine's (fixed_point.scale_exponents, with its headroom). A parameter whose
  micro-batch-0 gradient is zero (or not finite) borrows the largest exponent over the whole model, known
  only once every unit has sent its maxima: its part of each rank's first micro-batch is held aside and
  reduce-scattered at that micro-batch's end (`_settle_deferred`); rare, and only that parameter's part.
- sum: each micro-batch's input is rounded onto the grid in float64, reduce-scattered in float64 over the
  shard group, all-reduced over the replica groups (HSDP: FSDP2's own HSDP all-reduce is a plain float
  sum, so the run shards over a 1-D mesh and the cross-group sum happens here), and added to this rank's
  float64 accumulator of its shard: integers below 2**53, exact in any order. FSDP2 gets zeros back (it
  would otherwise add micro-batches in float32); `reduce()` writes the mean into the sharded `.grad`s.
- overflow: every rank measures each micro-batch's per-parameter maxima on its unsharded input; a step
  in which one exceeds the headroom is redone at the agreed maxima, as in the replicated engine.
- mean: `.grad` = sum * 2**-s_i / K, the replicated engine's expression element for element (a multiply
  in float64, one rounding to the parameter's dtype), so the shards hold the replicated mean's bits.

Every parameter that requires a gradient takes part in every reduce-scatter (FSDP2's
`set_reduce_scatter_unused_params`): one that no micro-batch used gets a zero gradient, not None (the
replicated engine leaves it None). Every rank must compute the same number of micro-batches (K a multiple
of the world size): each of them is a reduce-scatter on every rank of the shard group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.deterministic.fixed_point import (
    EXACT_BITS,
    HEADROOM_BITS,
    overflow_limits,
    powers_of_two,
    scale_exponents,
    sum_bits,
)
from lockstep.engine.sharded.comms import PlainBuffers
from lockstep.errors import ConfigError, InternalError
from lockstep.runtime.waits import tracked, wait_watching_membership
from lockstep.torch_private import FSDPReduceScatter


@dataclass(frozen=True)
class Segment:
    """One parameter's part of a unit: its place in each rank's chunk of the reduce-scatter input."""

    index: int  # the parameter's index over the whole model (the order of ShardedExactReducer.params)
    offset: int  # where its chunk starts in a rank's chunk of the input (and in the shard accumulator)
    chunk: int  # its padded chunk's elements (dim 0 cut in shard_world pieces, rounded up)
    local: int  # the elements of this rank's shard (the padded chunk's first ones)


class UnitLayout:
    """Where the parameters of one FSDP unit lie in its reduce-scatter input, as FSDP2 lays them out
    (`chunk_cat` on dim 0: each rank's chunk is every parameter's padded piece, in the unit's order)."""

    def __init__(self, params: Sequence[Any], indices: Sequence[int], shard_world: int) -> None:
        self.params, self.segments = list(params), []
        offset = 0
        for p, index in zip(params, indices):
            rows = p.shape[0] if p.dim() > 0 else 1
            rest = p.numel() // rows if rows else 0
            chunk = -(-rows // shard_world) * rest
            self.segments.append(Segment(index, offset, chunk, p.to_local().numel()))
            offset += chunk
        self.chunk_numel = offset

    def per_element(self, values: torch.Tensor) -> torch.Tensor:
        """A float64 row of a rank's chunk: each parameter's value from `values` (indexed over the model)."""
        index = torch.tensor([s.index for s in self.segments], device=values.device)
        counts = torch.tensor([s.chunk for s in self.segments], device=values.device)
        return torch.repeat_interleave(values[index], counts)

    def maxima(self, rows: torch.Tensor) -> torch.Tensor:
        """Per parameter of the unit, max |g| over `rows` (the input viewed as world x chunk), float64."""
        out = torch.zeros(len(self.segments), dtype=torch.float64, device=rows.device)
        for k, s in enumerate(self.segments):
            if s.chunk:
                low, high = torch.aminmax(rows[:, s.offset : s.offset + s.chunk])
                out[k] = torch.maximum(high, -low).double()
        return out


class ExactReduceScatter(PlainBuffers, FSDPReduceScatter):
    """The reduce-scatter FSDP2 calls for one unit: hands the input to the run's reducer (exact sums) and
    gives FSDP2 zeros (the mean is written into `.grad` once the step's micro-batches are done)."""

    def __init__(self, reducer: ShardedExactReducer, unit: int) -> None:
        self.reducer, self.unit = reducer, unit

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        self.reducer.scatter(self.unit, input_tensor)
        output_tensor.zero_()


class ShardedExactReducer:
    """Deterministic mode's exact sums over a model's FSDP units (see the module doc): one step at a time,
    begin() .. micro-batches .. reduce(), driven by the engine's micro-step loop (deterministic/micro_step.py)."""

    def __init__(
        self,
        units: Sequence[Sequence[Any]],
        *,
        shard_group: dist.ProcessGroup,
        replicate_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.shard_group, self.replicate_group, self.device = shard_group, replicate_group, device
        self.shard_world = dist.get_world_size(shard_group)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params: list[Any] = [p for unit in units for p in unit]
        self.layouts, start = [], 0
        for unit in units:
            self.layouts.append(UnitLayout(unit, range(start, start + len(unit)), self.shard_world))
            start += len(unit)
        self._n = len(self.params)
        self._acc = [torch.zeros(u.chunk_numel, dtype=torch.float64, device=device) for u in self.layouts]
        self.num_micro_batches = 1
        self.active = False  # a step is between begin() and its end
        self.redos = 0
        self.bytes_sent = 0  # inside the shard group
        self.bytes_between = 0  # across the replica groups

    # ---- begin -------------------------------------------------------------------------------------------

    def begin(self, num_micro_batches: int, maxima: torch.Tensor | None = None) -> None:
        """Start a step of K micro-batches; `maxima` (a redo): the agreed maxima, at no headroom."""
        if not all(p.requires_grad for p in self.params):
            frozen = next(i for i, p in enumerate(self.params) if not p.requires_grad)
            raise ConfigError(
                f"parameter {frozen} of the sharded model stopped requiring a gradient after shard(): the exact "
                "sums read FSDP2's reduce-scatter by the layout shard() saw; set requires_grad before shard()"
            )
        self.num_micro_batches, self.active = num_micro_batches, True
        for acc in self._acc:
            acc.zero_()
        self._held = [p.grad for p in self.params]  # a program's own gradients, added back at the end
        for p in self.params:
            p.grad = None
        self._first = True  # this rank's first micro-batch of the step is running
        self._maxima = torch.zeros(self._n, dtype=torch.float64, device=self.device)  # over all micro-batches
        # per parameter: micro-batches over the scale, not finite, reduce-scattered (0: no rank ran its unit)
        self._flags = torch.zeros(3, self._n, dtype=torch.float64, device=self.device)
        self._mb0 = torch.zeros(self._n, dtype=torch.float64, device=self.device)  # micro-batch 0's maxima
        self._deferred: list[tuple[int, torch.Tensor, list[int]]] = []  # (unit, held rows, its segments)
        # per parameter, once the scale is known: 2**s, 2**-s / K, the overflow limit
        self._mult: torch.Tensor | None = None
        self._factor: torch.Tensor | None = None
        self._limit: torch.Tensor | None = None
        self._known = torch.zeros(self._n, dtype=torch.bool, device="cpu")
        if maxima is not None:
            self._set_scale(maxima, headroom=0, which=torch.ones(self._n, dtype=torch.bool, device="cpu"))

    def _set_scale(self, maxima: torch.Tensor, *, headroom: int, which: torch.Tensor) -> None:
        """The scale of the parameters in `which` (a mask over the model) from `maxima` (the whole model's:
        a parameter without a magnitude borrows the largest exponent among them, as the replicated engine)."""
        k = self.num_micro_batches
        shifts = scale_exponents(maxima, k, headroom)
        mult, factor = powers_of_two(shifts), powers_of_two(-shifts).mul_(1.0 / k)
        limit = overflow_limits(shifts, k)
        if self._mult is None or self._factor is None or self._limit is None:
            self._mult, self._factor, self._limit = mult, factor, limit
        else:
            mask = which.to(self.device)
            self._mult = torch.where(mask, mult, self._mult)
            self._factor = torch.where(mask, factor, self._factor)
            self._limit = torch.where(mask, limit, self._limit)
        self._known |= which.cpu()

    # ---- micro-batches -----------------------------------------------------------------------------------

    def start_micro_batch(self, *, last: bool) -> None:
        self._last = last

    def end_micro_batch(self) -> None:
        """After a micro-batch's backward (every unit reduce-scattered): the first one's deferred parts."""
        if self._first and not bool(self._known.all()):
            self._set_scale(self._mb0, headroom=HEADROOM_BITS, which=~self._known)
            self._settle_deferred()
        self._first = False

    @torch.no_grad()
    def scatter(self, unit: int, flat_input: torch.Tensor) -> None:
        """One unit's reduce-scatter of one micro-batch (FSDP2's post-backward calls it)."""
        layout = self.layouts[unit]
        if not self.active:
            raise ConfigError(
                "a backward of a model sharded with ShardPolicy(deterministic=True) ran outside "
                "handle.accumulate(): its gradients are exact sums only there; run each step through it"
            )
        if flat_input.numel() != self.shard_world * layout.chunk_numel:
            raise InternalError(
                f"FSDP unit {unit}'s reduce-scatter input has {flat_input.numel()} elements, the layout "
                f"{self.shard_world} x {layout.chunk_numel}: a parameter started requiring a gradient after "
                "shard() (set requires_grad before it), or FSDP2 laid out its gradients unlike lockstep's reading"
            )
        rows = flat_input.view(self.shard_world, layout.chunk_numel)
        largest = layout.maxima(rows)
        indices = torch.tensor([s.index for s in layout.segments], device=self.device)
        self._flags[2, indices] = 1.0
        if self._first and not bool(self._known[indices.cpu()].all()):
            self._agree_on_scale(layout, indices, largest)
        ready = self._known[indices.cpu()]
        if not bool(ready.all()):
            rows = self._defer(unit, rows, ready)
        self._fold(indices[ready.to(self.device)], largest[ready.to(self.device)])
        self._sum(unit, rows, layout.per_element(self._mult_known()))

    def _agree_on_scale(self, layout: UnitLayout, indices: torch.Tensor, largest: torch.Tensor) -> None:
        """Rank 0's micro-batch-0 maxima of this unit's parameters, to every rank; the scale of those with a
        magnitude follows (the others wait for the whole model's: end_micro_batch)."""
        sent = largest.clone() if self.rank == 0 else torch.zeros_like(largest)
        if self.world > 1:
            with tracked("broadcast (FSDP unit gradient scale)", (sent,), None):
                wait_watching_membership(dist.broadcast(sent, src=0, async_op=True))
        self._mb0[indices] = sent
        finite = torch.isfinite(sent) & (sent > 0)
        which = torch.zeros(self._n, dtype=torch.bool, device="cpu")
        which[indices.cpu()[finite.cpu()]] = True
        if bool(which.any()):
            self._set_scale(self._mb0, headroom=HEADROOM_BITS, which=which)
        # _set_scale read the whole model's maxima so far for the borrowed exponent: only `which` is kept

    def _mult_known(self) -> torch.Tensor:
        """2**s of every parameter whose scale is known, 0 for the others (their part is deferred)."""
        if self._mult is None:
            return torch.zeros(self._n, dtype=torch.float64, device=self.device)
        return torch.where(self._known.to(self.device), self._mult, torch.zeros_like(self._mult))

    def _defer(self, unit: int, rows: torch.Tensor, ready: torch.Tensor) -> torch.Tensor:
        """Hold aside the parts of parameters whose scale is not known yet; the rest is summed now."""
        layout = self.layouts[unit]
        waiting = [k for k, r in enumerate(ready.tolist()) if not r]
        parts = [rows[:, s.offset : s.offset + s.chunk] for s in (layout.segments[k] for k in waiting)]
        self._deferred.append((unit, torch.cat(parts, dim=1).clone(), waiting))
        return rows

    def _settle_deferred(self) -> None:
        """The first micro-batch's held parts, now that their scale is known: summed like any other."""
        for unit, held, waiting in self._deferred:
            layout = self.layouts[unit]
            segments = [layout.segments[k] for k in waiting]
            indices = torch.tensor([s.index for s in segments], device=self.device)
            sub = UnitLayout.__new__(UnitLayout)
            sub.segments, sub.chunk_numel, offset = [], held.shape[1], 0
            for s in segments:
                sub.segments.append(Segment(s.index, offset, s.chunk, s.local))
                offset += s.chunk
            self._fold(indices, sub.maxima(held))
            total = self._reduce(held, sub.per_element(self._mult_known()))
            acc = self._acc[unit]
            for s, t in zip(segments, sub.segments):
                acc[s.offset : s.offset + s.chunk] += total[t.offset : t.offset + t.chunk]
        self._deferred = []

    def _fold(self, indices: torch.Tensor, largest: torch.Tensor) -> None:
        """A micro-batch's maxima of some parameters: overflow and non-finite flags, the step's maxima."""
        if indices.numel() == 0:
            return
        limit = self._limit[indices] if self._limit is not None else None
        if limit is None:
            raise InternalError("a micro-batch's maxima were folded before the scale was known")
        self._flags[0, indices] += (largest >= limit).double()
        self._flags[1, indices] += (~torch.isfinite(largest)).double()
        self._maxima[indices] = torch.maximum(self._maxima[indices], largest)

    def _sum(self, unit: int, rows: torch.Tensor, mult: torch.Tensor) -> None:
        self._acc[unit] += self._reduce(rows, mult)

    def _reduce(self, rows: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
        """round(rows * 2**s) summed over the shard group (each rank keeps its chunk) and the replica
        groups: float64 integers, exact."""
        staged = rows.to(torch.float64).mul_(mult).round_()
        total = torch.empty(rows.shape[1], dtype=torch.float64, device=rows.device)
        with tracked("reduce_scatter (FSDP exact gradients)", (staged,), self.shard_group):
            wait_watching_membership(
                dist.reduce_scatter_single(
                    output=total, input=staged.view(-1), group=self.shard_group, async_op=True
                )
            )
        self.bytes_sent += staged.numel() * staged.element_size()
        if self.replicate_group is not None:
            with tracked(
                "allreduce (HSDP exact gradients across replica groups)", (total,), self.replicate_group
            ):
                wait_watching_membership(dist.all_reduce(total, group=self.replicate_group, async_op=True))
            self.bytes_between += total.numel() * total.element_size()
        return total

    # ---- reduce ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce(self) -> torch.Tensor | None:
        """The step's end: None once `.grad` holds the exact mean, else (on every rank alike) the agreed
        maxima to redo the step with (a micro-batch overflowed its scale)."""
        flags = self._flags
        if self.world > 1:
            with tracked("allreduce (FSDP exact gradients: flags)", (flags,), None):
                wait_watching_membership(dist.all_reduce(flags, async_op=True))
        finite, scattered = flags[1] == 0, (flags[2] > 0).tolist()
        if bool(((flags[0] > 0) & finite).any()):
            return self._agreed_maxima()
        factor = self._factor
        if factor is None:
            raise InternalError("the step ended before any scale was known")
        nonfinite = (~finite).tolist()
        for unit, layout in enumerate(self.layouts):
            acc = self._acc[unit]
            for p, s in zip(layout.params, layout.segments):
                if not scattered[s.index]:  # its unit ran no forward on any rank: no gradient, as replicated
                    p.grad = self._held[s.index]
                    continue
                grad = p.grad
                if grad is None:
                    raise InternalError(f"FSDP left parameter {s.index} without a gradient after the step")
                local = grad.to_local()
                if nonfinite[s.index]:
                    local.fill_(float("nan"))
                else:
                    local.view(-1).copy_(acc[s.offset : s.offset + s.local].mul(factor[s.index]))
                held = self._held[s.index]
                if held is not None:
                    local.add_(held.to_local())
        self._held = [None] * self._n
        return None

    def _agreed_maxima(self) -> torch.Tensor:
        maxima = self._maxima.clone()
        if self.world > 1:
            with tracked("allreduce max (FSDP gradient maxima)", (maxima,), None):
                wait_watching_membership(dist.all_reduce(maxima, op=dist.ReduceOp.MAX, async_op=True))
        for p, held in zip(self.params, self._held):  # back as the step found them, for the redo
            p.grad = held
        self.redos += 1
        return maxima


__all__ = ["EXACT_BITS", "ExactReduceScatter", "ShardedExactReducer", "UnitLayout", "sum_bits"]
