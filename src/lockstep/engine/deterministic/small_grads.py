"""Deterministic mode's small gradients: views of one flat buffer, handled as a few whole-vector operations.

A model of hundreds of tiny layers would pay a few kernel launches and Python calls per parameter and
micro-batch if each small gradient were taken alone. Instead each small parameter's `.grad` is a view of
one flat buffer, which autograd accumulates into (it adds into an existing `.grad` in place); the buffer
is zeroed before each micro-batch. The parameters are laid out by size, so that each run of equal-sized
parameters is a 2-D block [count, numel]: per-parameter maxima and scales are then one operation per
block (a model has a handful of distinct small sizes), with no per-element table to rebuild when a scale
changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Block:
    start: int  # first element in the flat buffer
    first: int  # position of its first parameter in flat order
    count: int  # parameters in the block
    numel: int  # elements of each


class SmallGradients:
    """The small parameters' gradient buffer, its views, and what a program left in `.grad` before a step."""

    def __init__(self, params: Sequence[torch.Tensor], indices: Sequence[int], device: torch.device) -> None:
        order = sorted(indices, key=lambda i: (params[i].numel(), i))
        self.indices = order  # parameter indices in flat order
        self.params = [params[i] for i in order]
        sizes = [p.numel() for p in self.params]
        self.size = sum(sizes)
        first = self.params[0] if self.params else None
        grad_device = first.device if first is not None else device
        self.grads = torch.zeros(
            self.size, dtype=first.dtype if first is not None else torch.float32, device=grad_device
        )
        self.views = [v.view_as(p) for p, v in zip(self.params, self.grads.split(sizes))]
        self.blocks = _blocks(sizes)
        self.index = torch.tensor(order, dtype=torch.long, device=device)  # into per-parameter tensors
        self._stage = torch.empty(self.size, dtype=torch.float64, device=grad_device)
        self._held: torch.Tensor | None = None
        self.had_held = [False] * len(order)

    def begin(self) -> None:
        """Gradients left on the parameters (perhaps in this very buffer) are copied aside; then every
        parameter gets its view of the zeroed buffer."""
        left = [(k, p.grad) for k, p in enumerate(self.params)]
        held = [(k, grad) for k, grad in left if grad is not None]
        self.had_held = [False] * len(self.params)
        self._held = None
        if held:
            self._held = torch.zeros_like(self.grads)
            holds = self._held.split([p.numel() for p in self.params])
            for k, grad in held:
                holds[k].copy_(grad.detach().reshape(-1))
                self.had_held[k] = True
        self.grads.zero_()
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view

    def reattach(self) -> None:
        """After a backward: a `.grad` that autograd replaced (create_graph adds out of place) is copied in."""
        for p, view in zip(self.params, self.views):
            grad = p.grad
            if grad is not view:
                if grad is not None:
                    view.copy_(grad.detach())
                p.grad = view

    def maxima(self) -> torch.Tensor:
        """max |grad| per parameter in flat order (float64; NaN where a gradient has one)."""
        parts = []
        for b in self.blocks:
            block = self.grads[b.start : b.start + b.count * b.numel].view(b.count, b.numel)
            if b.numel == 0:
                parts.append(torch.zeros(b.count, dtype=torch.float64, device=block.device))
                continue
            # amax and amin: aminmax along a dimension is twenty times slower on CPU
            parts.append(torch.maximum(block.amax(dim=1), -block.amin(dim=1)).to(torch.float64))
        if not parts:
            return torch.zeros(0, dtype=torch.float64, device=self.grads.device)
        return torch.cat(parts)

    @torch.no_grad()
    def add_on_grid(
        self, acc: torch.Tensor, multipliers: torch.Tensor, source: torch.Tensor | None = None
    ) -> None:
        """acc += round(grad * 2**s) for every small gradient (exact; `multipliers`: 2**s per parameter in
        flat order). The gradients are the buffer's, which is then zeroed for the next micro-batch, or
        `source`'s (a copy of the buffer kept from an earlier micro-batch)."""
        stage = self._stage.copy_(self.grads if source is None else source)
        self._per_parameter(stage, multipliers.to(stage.device))
        acc.add_(stage.round_().to(acc.device))
        if source is None:
            self.grads.zero_()

    @torch.no_grad()
    def write(self, total: torch.Tensor, factors: torch.Tensor, keep: list[bool], nan: list[bool]) -> None:
        """grad = total * 2**-s / K per parameter (`factors`, flat order), plus what was held; `keep[k]`
        False leaves parameter k without a gradient, `nan[k]` True fills it with NaN (flat order)."""
        summed = total.to(self._stage.device)
        self._per_parameter(summed, factors.to(summed.device))
        self.grads.copy_(summed)
        if self._held is not None:
            self.grads.add_(self._held)
        for k, (p, view) in enumerate(zip(self.params, self.views)):
            if nan[k]:
                view.fill_(float("nan"))
            if not keep[k] and not self.had_held[k]:
                p.grad = None
        self._held = None

    def restore(self) -> None:
        """Back as the step found them (for a redo): the held gradients, or none."""
        holds = self._held.split([p.numel() for p in self.params]) if self._held is not None else None
        for k, p in enumerate(self.params):
            p.grad = holds[k].view_as(p).clone() if holds is not None and self.had_held[k] else None
        self._held = None

    def _per_parameter(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """flat[parameter k's elements] *= values[k], one broadcast multiply per block."""
        for b in self.blocks:
            block = flat[b.start : b.start + b.count * b.numel].view(b.count, b.numel)
            block.mul_(values[b.first : b.first + b.count, None])


def _blocks(sizes: list[int]) -> list[_Block]:
    """Runs of equal sizes (the sizes are sorted) as blocks."""
    blocks: list[_Block] = []
    start = 0
    for position, numel in enumerate(sizes):
        last = blocks[-1] if blocks else None
        if last is not None and last.numel == numel:
            blocks[-1] = _Block(last.start, last.first, last.count + 1, numel)
        else:
            blocks.append(_Block(start, position, 1, numel))
        start += numel
    return blocks
