"""`accumulate()` under the default policy: deterministic mode's step, with the engine's own float sum.

Live mode redoes a step over the survivors with the same global batch, cut into the same K micro-batches
(their ordinals do not depend on the world size, only their owners do). Deterministic mode sums their
gradients exactly; this step is its fast counterpart for everyone who does not need the same bits at
every world size. Rank r runs its micro-batches r, r + W, ... with everything but the reduction as in
deterministic mode: random numbers seeded from (seed, step, ordinal), BatchNorm statistics per
micro-batch (SyncBatchNorm communicates nothing inside the step, so ranks that own different numbers of
micro-batches never wait on each other), running buffers replayed in ordinal order. Gradients are summed
locally (no_sync) and reduced by the bucketed all-reduce of the last backward, overlapped with it, like
any DDP step; the engine averages over the W ranks, so the gradients are then scaled by W / K into the
mean over the K micro-batches. The result differs from a run at another world size only by float
rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from lockstep.engine.deterministic import check_micro_batches, cuda_devices, seeded
from lockstep.engine.running_stats import RunningStats
from lockstep.engine.syncbn import micro_batch_statistics
from lockstep.errors import ConfigError, rank_tag
from lockstep.runtime.micro_batches import micro_batch_seed, owned_micro_batches

if TYPE_CHECKING:
    from lockstep.engine.state import ReplicaState


class FloatStep:
    """Runs micro-batched steps for one replica of the default policy: float sums, the usual buckets."""

    def __init__(self, replica: ReplicaState) -> None:
        self.replica = replica
        self.running = RunningStats(replica.module)
        self.steps = 0
        self._cuda = cuda_devices(replica.module)

    def owned(self, num_micro_batches: int) -> list[int]:
        return owned_micro_batches(num_micro_batches, self.replica.world, self.replica.rank)

    def run(
        self,
        fn: Callable[[Any], Any],
        batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int,
    ) -> dict[int, Any]:
        replica = self.replica
        world, rank = replica.world, replica.rank
        owned = check_micro_batches(batches, num_micro_batches, step, rank=rank, world=world)
        if num_micro_batches < world:  # every rank knows K and W: all raise, none waits in an all-reduce
            raise ConfigError(
                f"{rank_tag(rank, world)}accumulate() with {num_micro_batches} micro-batches on {world} ranks: "
                "under the default policy every rank needs at least one (its backward joins the all-reduce); "
                "use more micro-batches per step, fewer ranks, or SyncPolicy(deterministic=True)"
            )
        replica.broadcast_buffers_for_step()
        self.running.begin()
        results = {}
        for k in owned:
            last = k == owned[-1]  # its backward all-reduces the rank's summed gradients
            with contextlib.nullcontext() if last else replica.no_sync():
                with seeded(micro_batch_seed(seed, step, k), self._cuda), micro_batch_statistics():
                    self.running.ordinal = k
                    try:
                        results[k] = fn(batches[k])
                    finally:
                        self.running.ordinal = None
        self._to_mean(world / num_micro_batches)
        self.running.finish(num_micro_batches, replica.group)
        self.steps += 1
        return results

    def _to_mean(self, scale: float) -> None:
        """The engine averaged the ranks' sums (÷ W); × W / K makes it the mean over the K micro-batches."""
        if scale == 1.0:
            return
        with torch.no_grad():
            for p in self.replica.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    def remove(self) -> None:
        self.running.remove()
