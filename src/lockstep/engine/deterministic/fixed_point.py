"""The arithmetic of deterministic mode's exact sums: per-parameter scales and fixed-point kernels.

A gradient g is put on the grid of parameter i as q = round(g * 2**s_i), in float64: scaling by a power of
two is exact, and so is rounding to an integer. Every integer of magnitude up to 2**53 is a float64, so a
sum of such q's is exact whatever the order (exact.py keeps them small enough). The kernels work a piece
of CHUNK_ELEMENTS at a time so that the float64 staging stays in cache, and they never allocate a tensor
the size of a parameter: on CPU, a fresh 100 MB tensor costs more in page faults than the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

HEADROOM_BITS = 12  # a micro-batch's gradient may be up to 2**12 times micro-batch 0's before a redo
EXACT_BITS = 53  # float64 represents every integer of magnitude <= 2**53
CHUNK_ELEMENTS = 1 << 18  # a piece of a gradient quantized at once: its float64 staging is 2 MiB
_MAX_SHIFT = 1000  # |s| stays inside float64's exponent range


def sum_bits(num_micro_batches: int) -> int:
    """Bits a sum of K values needs beyond one of them."""
    return max(math.ceil(math.log2(max(num_micro_batches, 1))), 0)


def scale_exponents(maxima: torch.Tensor, num_micro_batches: int, headroom: int) -> torch.Tensor:
    """s_i per parameter (int64, on maxima's device) from the largest |gradient| of each: pure arithmetic.

    s_i = 53 - headroom - ceil(log2 K) - e_i, where max|g_i| < 2**e_i. A maximum of zero or a non-finite
    one says nothing about the magnitude: such a parameter borrows the largest exponent of the others (a
    redo follows only if its gradients turn out larger than that).
    """
    finite = torch.isfinite(maxima) & (maxima > 0)
    exponents = torch.frexp(maxima.double()).exponent.to(torch.int64)  # maxima < 2**exponent
    if bool(finite.any()):
        exponents = torch.where(finite, exponents, exponents[finite].max())
    else:
        exponents = torch.zeros_like(exponents)
    top = EXACT_BITS - headroom - sum_bits(num_micro_batches)
    return (top - exponents).clamp_(-_MAX_SHIFT, _MAX_SHIFT)


def powers_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """2**e as float64 for int64 exponents in [-1022, 1023], built from the bits: exact by construction
    (a vectorized exp2 or pow need not be correctly rounded)."""
    return ((exponents + 1023) << 52).view(torch.float64)


def overflow_limits(shifts: torch.Tensor, num_micro_batches: int) -> torch.Tensor:
    """Per parameter, the |gradient| at which a micro-batch no longer fits K times below 2**53."""
    top = EXACT_BITS - sum_bits(num_micro_batches)
    return powers_of_two((top - shifts).clamp_(-_MAX_SHIFT, _MAX_SHIFT))


def largest_magnitude(grad: torch.Tensor) -> torch.Tensor:
    """max |grad| as a 0-d float64 tensor (NaN if any element is NaN); one vectorized pass, no temporary."""
    if grad.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=grad.device)
    low, high = torch.aminmax(grad.detach())
    return torch.maximum(high, -low).to(torch.float64)


class Quantizer:
    """acc (+)= round(grad * 2**s) piece by piece through a reused float64 staging buffer per device."""

    def __init__(self) -> None:
        self._stages: dict[torch.device, torch.Tensor] = {}

    def _stage(self, device: torch.device, numel: int) -> torch.Tensor:
        if device.type != "cpu":  # a caching allocator makes a temporary cheap; keep no float64 copy there
            return torch.empty(numel, dtype=torch.float64, device=device)
        stage = self._stages.get(device)
        if stage is None or stage.numel() < numel:
            stage = self._stages[device] = torch.empty(numel, dtype=torch.float64, device=device)
        return stage[:numel]

    @torch.no_grad()
    def add(
        self, acc: torch.Tensor, grads: Sequence[torch.Tensor], multiplier: float, *, first: bool
    ) -> torch.Tensor:
        """acc (flat float64) = the sum of round(grad * multiplier) over `grads` (plus acc unless `first`):
        exact. Several gradients of one parameter go in one pass over acc. Returns max |grads[-1]| (0-d
        float64, NaN if any element is), measured on each piece while it is in cache."""
        sources = [grad.detach().reshape(-1) for grad in grads]
        numel = acc.numel()
        piece = max(numel, 1) if acc.is_cuda else CHUNK_ELEMENTS
        extremes: list[torch.Tensor] = []
        for start in range(0, numel, piece):
            target = acc[start : start + piece]
            for j, source in enumerate(sources):
                part = source[start : start + piece]
                staged = (
                    target.copy_(part)
                    if first and j == 0
                    else self._stage(acc.device, part.numel()).copy_(part)
                )
                if j == len(sources) - 1:
                    extremes.extend(torch.aminmax(staged))
                staged.mul_(multiplier).round_()
                if staged is not target:
                    target.add_(staged)
        if not extremes:
            return torch.zeros((), dtype=torch.float64, device=acc.device)
        both = torch.stack(extremes)
        return torch.maximum(both.max(), -both.min())

    @torch.no_grad()
    def write_mean(self, out: torch.Tensor, total: torch.Tensor, factor: float) -> torch.Tensor:
        """out = total * factor (factor = 2**-s / K, in float64), rounded once to out's dtype, piece by piece."""
        flat_out = out.view(-1) if out.is_contiguous() else None
        if flat_out is None or total.is_cuda:
            out.copy_(total.mul_(factor).view(out.shape))
            return out
        for start in range(0, total.numel(), CHUNK_ELEMENTS):
            part = total[start : start + CHUNK_ELEMENTS]
            stage = self._stage(total.device, part.numel())
            flat_out[start : start + part.numel()].copy_(torch.mul(part, factor, out=stage))
        return out
