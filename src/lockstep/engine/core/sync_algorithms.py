"""The periodic sync algorithms, one small class each, and `parse_sync`: the one place a `sync` name is read.

`SyncPolicy.sync` and `FitConfig.sync` stay strings (the public API); `parse_sync` turns one into the
algorithm's class (None: "allreduce", gradients averaged every step) and everything else asks that:
`SyncPolicy.algorithm` / `.periodic`, the class's flags, and the instance OuterSync holds.

An algorithm says what one fragment of the model contributes to a sync and what the mean over the ranks
does to it; engine/periodic/outer_sync.py (OuterSync) does what they share: the fragments and their schedule, the
float32 anchors, the mean (its wire dtype, the rank-order sum), the buffers, the counts and the state a
resume needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from lockstep.errors import ConfigError, InternalError
from lockstep.plan import SYNC_MODES

EVERY_STEP = SYNC_MODES[
    0
]  # "allreduce", the default sync: no periodic algorithm, gradients averaged in backward
MIX = 0.5  # streaming_diloco: the default local share when a delayed outer step is merged (SyncPolicy.mix)


@dataclass
class Fragment:
    """A piece of the model that syncs as one: its parameters, their float32 anchors (the values at the
    last sync) and the outer optimizer that steps the anchors (none for local SGD)."""

    params: list[torch.Tensor]
    anchor: list[torch.Tensor]
    outer: torch.optim.Optimizer | None = None


class SyncAlgorithm(ABC):
    """One periodic sync algorithm (the interface OuterSync holds).

    - fragmented: the model syncs in `SyncPolicy.fragments` pieces (otherwise in one);
    - delayed: a fragment's mean is applied SyncPolicy.fragment_delay inner steps after its launch,
      overlapping them, so
      the replicas are never all equal (live mode marks every fragment's sync, without waiting);
    - fragment(): a piece of the model with the state the algorithm keeps for it;
    - contribution(): what the piece sends (its mean over the ranks comes back to apply());
    - apply(): the mean's effect on the piece (under torch.no_grad()).
    """

    name: ClassVar[str]
    fragmented: ClassVar[bool] = False
    delayed: ClassVar[bool] = False

    def __init__(self, *, mix: float = MIX, momentum_warmup: int = 0) -> None:
        self.mix = mix  # streaming_diloco's local share in a merge (SyncPolicy.mix)
        self.momentum_warmup = (
            momentum_warmup  # DiLoCo's outer momentum ramp (SyncPolicy.outer_momentum_warmup)
        )

    def fragment(self, params: list[torch.Tensor], *, outer_lr: float, outer_momentum: float) -> Fragment:
        return Fragment(params, [])

    @abstractmethod
    def contribution(self, fragment: Fragment) -> list[torch.Tensor]: ...

    @abstractmethod
    def apply(self, fragment: Fragment, mean: list[torch.Tensor]) -> None: ...


class LocalSGD(SyncAlgorithm):
    """The parameters are averaged (torch's PostLocalSGD, without its synchronous warm-up)."""

    name = "local_sgd"

    def contribution(self, fragment: Fragment) -> list[torch.Tensor]:
        return [p.detach() for p in fragment.params]

    def apply(self, fragment: Fragment, mean: list[torch.Tensor]) -> None:
        for p, value in zip(fragment.params, mean):
            p.copy_(value)


class DiLoCo(SyncAlgorithm):
    """The outer gradient, anchor - local, is averaged; an outer SGD step (Nesterov momentum when
    outer_momentum > 0) moves the anchor, and the replica starts the next round from it."""

    name = "diloco"

    def fragment(self, params: list[torch.Tensor], *, outer_lr: float, outer_momentum: float) -> Fragment:
        with torch.no_grad():
            anchor = [p.detach().float().clone() for p in params]
        outer = torch.optim.SGD(anchor, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        for group in outer.param_groups:  # kept in the optimizer's state_dict: a resume ramps on from there
            group["target_momentum"], group["outer_steps"] = outer_momentum, 0
        return Fragment(params, anchor, outer)

    def momentum_at(self, step: int, target: float) -> float:
        """The outer momentum of a fragment's `step`-th outer step (1-based): rising linearly from 0 at the
        first to `target` after momentum_warmup steps. Early outer gradients are large and change fast
        (the model is far from trained); a momentum of 0.9 from the first one sums them into an overshoot
        (benchmarks/results/2026-11-27-diloco_defaults.md)."""
        if self.momentum_warmup <= 0:
            return target
        return target * min(1.0, (step - 1) / self.momentum_warmup)

    def contribution(self, fragment: Fragment) -> list[torch.Tensor]:
        return [a - p.detach().float() for a, p in zip(fragment.anchor, fragment.params)]

    def apply(self, fragment: Fragment, mean: list[torch.Tensor]) -> None:
        if fragment.outer is None:
            raise InternalError(
                f"{self.name}: a fragment without its outer optimizer (not made by fragment())"
            )
        for a, grad in zip(fragment.anchor, mean):
            a.grad = grad.view(a.shape)
        for group in fragment.outer.param_groups:
            group["outer_steps"] += 1
            group["momentum"] = self.momentum_at(group["outer_steps"], group["target_momentum"])
        fragment.outer.step()
        for a in fragment.anchor:
            a.grad = None
        self.take(fragment)

    def take(self, fragment: Fragment) -> None:
        """The stepped anchor becomes the parameters."""
        for p, a in zip(fragment.params, fragment.anchor):
            p.copy_(a)


class StreamingDiLoCo(DiLoCo):
    """DiLoCo on fragments whose syncs are staggered over the round; a fragment's outer step lands one
    inner step after its launch and is merged into the local values that moved on meanwhile:
    mix * local + (1 - mix) * global (Streaming DiLoCo's merge, alpha = SyncPolicy.mix). The anchor stays
    the global value (the outer step's result, before the mix): the fragment's next outer gradient is
    taken against it, and the local progress the mix keeps is part of that gradient."""

    name = "streaming_diloco"
    fragmented = True
    delayed = True

    def take(self, fragment: Fragment) -> None:
        for p, a in zip(fragment.params, fragment.anchor):
            p.copy_(p.float().mul_(self.mix).add_(a, alpha=1 - self.mix))


# The names are lockstep.plan's (the launcher reads them without torch); tests/unit/test_sync_algorithms.py
# keeps the classes' names equal to them.
ALGORITHMS: dict[str, type[SyncAlgorithm]] = {cls.name: cls for cls in (LocalSGD, DiLoCo, StreamingDiLoCo)}


def parse_sync(sync: object, *, what: str = "sync") -> type[SyncAlgorithm] | None:
    """The algorithm a `sync` name selects; None for "allreduce" (every step). ConfigError names the
    choices for any other value (`what`: the setting, in the message)."""
    if isinstance(sync, str):
        if sync == EVERY_STEP:
            return None
        if sync in ALGORITHMS:
            return ALGORITHMS[sync]
    raise ConfigError(f"{what} must be one of {', '.join(SYNC_MODES)}; got {sync!r}")


def is_periodic(sync: str) -> bool:
    """True for the low-communication modes: the replicas meet every sync_every steps, not every step."""
    return parse_sync(sync) is not None
