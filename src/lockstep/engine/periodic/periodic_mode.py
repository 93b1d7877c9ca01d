"""The engine mode of low-communication training: no reduction in backward, an outer sync every H steps.

Chosen by `SyncPolicy(sync=...)` other than "allreduce" (mode.choose_mode). Forwards and backwards are
the module's own; `after_optimizer_step()` (through the handle) counts the rank's inner steps and runs
the outer sync when a round, or a fragment of one, is due (outer_sync.py). The features of the bucketed
reducer (hooks, join(), accumulate()) raise the NotSupportedError that says why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lockstep.engine.buckets.reducer import Reducer
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.stats import EngineStats
from lockstep.engine.deterministic.micro_step import MicroSteps
from lockstep.engine.optim.overlapped_optimizer import OverlappedOptimizer
from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.engine.periodic.outer_sync import OuterSync
from lockstep.errors import NotSupportedError

PERIODIC_REASON = (
    "with SyncPolicy(sync=...) other than 'allreduce' no gradient is averaged in backward, so there is "
    "nothing to overlap the optimizer with"
)


class PeriodicMode:
    """SyncPolicy(sync='local_sgd' | 'diloco' | 'streaming_diloco'): each replica steps alone, and meets
    the others every sync_every steps."""

    def __init__(self, module: nn.Module, policy: SyncPolicy, group: Any, *, world: int, tag: str) -> None:
        self.outer = OuterSync(module, policy, group, world=world)
        self._tag, self._sync = tag, policy.sync

    def _why(self, what: str) -> str:
        return (
            f"{self._tag}this replica runs SyncPolicy(sync={self._sync!r}): no gradient is averaged in "
            f"backward, so {what} do not apply; call handle.after_optimizer_step() after each optimizer step, "
            "or replicate with SyncPolicy() to average every step"
        )

    @property
    def reducer(self) -> Reducer:
        raise NotSupportedError(self._why("buckets, communication hooks and join()"))

    def pre_forward(self, replica: Any) -> None:
        pass  # the module's own forward: the replicas meet in after_optimizer_step()

    def post_forward(self, replica: Any, output: Any) -> None:
        pass

    def micro_steps(self, replica: Any) -> MicroSteps:
        raise NotSupportedError(self._why("accumulate() and owned_micro_batches()"))

    def accumulate(
        self,
        replica: Any,
        fn: Callable[[Any], Any],
        micro_batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int,
    ) -> dict[int, Any]:
        raise NotSupportedError(self._why("accumulate() and owned_micro_batches()"))

    def overlap_optimizer(
        self, replica: Any, optimizer: torch.optim.Optimizer | ShardedOptimizer, fallback: str | None
    ) -> OverlappedOptimizer:
        """The plain step, said once: no gradient is averaged in backward, so nothing overlaps with it."""
        return OverlappedOptimizer(optimizer, fallback=PERIODIC_REASON, tag=self._tag)

    def stats(self, world: int) -> EngineStats:
        outer = self.outer
        return EngineStats(
            world_size=world,
            num_parameters=len(outer.params),
            num_buckets=0,
            bucket_sizes_bytes=[],
            bucket_num_params=[],
            buckets_rebuilt=False,
            synced_steps=outer.outer_syncs,
            last=None,
            mean=None,
            extras={
                "sync": self._sync,
                "inner_steps": outer.inner_steps,
                "outer_syncs": outer.outer_syncs,
                "warmup_steps": outer.warmup_steps,
                "fragments": [len(f) for f in outer.fragments],
                "bytes_communicated_total": outer.bytes_sent,
            },
        )

    def remove(self) -> None:
        pass  # no hooks of its own
