"""How a sharded model's gradients are summed, chosen once per handle: lockstep's exact sums or FSDP2's own."""

from __future__ import annotations

import torch

from lockstep.engine.deterministic.exact_norm import exact_clip_grad_norm_
from lockstep.engine.deterministic.micro_step import ExactReduction, FloatHost, FloatReduction
from lockstep.engine.sharded.exact_scatter import ShardedExactReducer


class ExactSums:
    """Deterministic mode: lockstep's exact reduce-scatters (exact_scatter.py), the step redone on overflow,
    clipping with the exact norm."""

    clip = staticmethod(exact_clip_grad_norm_)

    def __init__(self, reducer: ShardedExactReducer) -> None:
        self.reducer = reducer
        self.reduction = ExactReduction(reducer)

    def bytes_sent(self) -> int:
        return self.reducer.bytes_sent

    def bytes_between(self) -> int:
        return self.reducer.bytes_between

    def redos(self) -> int:
        return self.reducer.redos


class FloatSums:
    """Otherwise: FSDP2's own reduce-scatter once per step, in each rank's last backward (its bytes are
    counted by the tracked comms), and torch's clipping."""

    clip = staticmethod(torch.nn.utils.clip_grad_norm_)

    def __init__(self, handle: FloatHost) -> None:
        self.reduction = FloatReduction(handle)

    def bytes_sent(self) -> int:
        return 0

    def bytes_between(self) -> int:
        return 0

    def redos(self) -> int:
        return 0
