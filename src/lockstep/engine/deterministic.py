"""Deterministic mode's training step: K micro-batches over the ranks, the same bits at any world size.

A step is a global batch cut into K micro-batches of a fixed size (the caller cuts it; the ordinals
0..K-1 do not depend on the world size). Rank r computes the micro-batches runtime.micro_batches assigns
it. Each one runs with everything that could depend on the rank made a function of the micro-batch
instead: its random numbers come from a seed of (seed, step, ordinal), SyncBatchNorm uses the
micro-batch's statistics, BatchNorm running buffers are replayed in ordinal order (running_stats.py), and
its gradient joins an exact fixed-point sum (exact.py). The averaged gradient is left in `.grad`, like a
synced backward; the optimizer step is the caller's, as always.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine.exact import ExactReducer
from lockstep.engine.running_stats import RunningStats
from lockstep.engine.syncbn import micro_batch_statistics
from lockstep.errors import ConfigError, rank_tag
from lockstep.runtime.micro_batches import micro_batch_seed, owned_micro_batches


class DeterministicStep:
    """Runs deterministic steps for one replica: micro-batches, exact reduction, redo on overflow."""

    def __init__(self, module: nn.Module, reducer: ExactReducer, group: dist.ProcessGroup | None) -> None:
        self.module, self.reducer, self.group = module, reducer, group
        self.running = RunningStats(module)
        self.steps = 0
        self.redos = 0  # steps run twice because a micro-batch overflowed micro-batch 0's scale
        self._cuda = cuda_devices(module)

    def owned(self, num_micro_batches: int) -> list[int]:
        return owned_micro_batches(num_micro_batches, self.reducer.world, self.reducer.rank)

    def run(
        self,
        fn: Callable[[Any], Any],
        batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int,
    ) -> dict[int, Any]:
        owned = check_micro_batches(
            batches, num_micro_batches, step, rank=self.reducer.rank, world=self.reducer.world
        )
        maxima = None
        try:
            while True:
                self.reducer.begin(num_micro_batches, maxima)
                self.running.begin()
                results = {
                    k: self._micro_batch(fn, batches[k], step, seed, k, last=k == owned[-1]) for k in owned
                }
                maxima = self.reducer.reduce()
                if maxima is None:
                    break
                self.redos += 1
            self.running.finish(num_micro_batches, self.group)
        finally:
            self.reducer.active = False
        self.steps += 1
        return results

    def _micro_batch(
        self, fn: Callable[[Any], Any], batch: Any, step: int, seed: int, ordinal: int, *, last: bool
    ) -> Any:
        self.reducer.start_micro_batch(last=last)
        with seeded(micro_batch_seed(seed, step, ordinal), self._cuda), micro_batch_statistics():
            self.running.ordinal = ordinal
            try:
                result = fn(batch)
            finally:
                self.running.ordinal = None
        self.reducer.end_micro_batch()
        return result


def cuda_devices(module: nn.Module) -> list[int]:
    """The CUDA devices of `module`'s parameters: their random streams are seeded per micro-batch too."""
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


@contextmanager
def seeded(seed: int, cuda: list[int]) -> Iterator[None]:
    """A micro-batch's own random stream; the caller's streams are untouched after it."""
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.manual_seed(seed)
        yield


def check_micro_batches(
    batches: Mapping[int, Any], num_micro_batches: int, step: int, *, rank: int, world: int
) -> list[int]:
    """This rank's ordinals of the step, once `batches` is known to hold exactly them (else ConfigError)."""
    tag = rank_tag(rank, world)
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ConfigError(f"{tag}num_micro_batches must be an int >= 1, got {num_micro_batches!r}")
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"{tag}step must be an int >= 0 (it seeds the step's random numbers), got {step!r}")
    owned = owned_micro_batches(num_micro_batches, world, rank)
    if sorted(batches) != owned:
        raise ConfigError(
            f"{tag}accumulate() got micro-batches {sorted(batches)!r} of {num_micro_batches}, expected this "
            f"rank's ordinals {owned!r} (rank r of W computes r, r + W, ...: handle.owned_micro_batches(K) "
            "says which; lockstep.data.MicroBatchSampler loads exactly those)"
        )
    return owned
