"""Optimizer and learning-rate schedule from a FitConfig, and the optimizer sharded over the ranks (ZeRO-1)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.trainer.settings.config import FitConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], config: FitConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based): linear warm-up, then decay."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress  # linear


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: FitConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(
            step, total_steps=total_steps, warmup_steps=config.warmup_steps, schedule=config.lr_schedule
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def maybe_sharded(
    optimizer: torch.optim.Optimizer, config: FitConfig, *, copies: int = 1, defer_gather: bool = False
) -> torch.optim.Optimizer | ShardedOptimizer:
    """The optimizer fit's steps run: sharded over the ranks (ZeRO-1) with config.shard_optimizer (the run's
    plan refused it with a periodic sync at the door). `copies`: ranks that keep each share; `defer_gather`:
    the all-gather waits until the step counted (fit's loop calls `gather()` after the step, `regroup()`
    after a change of members): live mode asks for both (trainer/live/live_side.py). With overlap_optimizer
    too, the engine steps this sharded optimizer bucket by bucket (trainer/run/steps.py, `stepped_optimizer`)."""
    if not config.shard_optimizer:
        return optimizer
    return ShardedOptimizer(optimizer, copies=copies, defer_gather=defer_gather)
