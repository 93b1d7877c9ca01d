"""fit's training data: the sampler (the order, and the position a resume continues from), the loader, and
how many of this rank's micro-batches make one step.

The default mode shards with `DistributedSampler` (torch's order) and a step is this rank's
`grad_accum_steps` micro-batches. Deterministic and live mode cut each step's global batch into K
micro-batches of a fixed size (`MicroBatchSampler`) and rank r of W loads micro-batches r, r + W, ...:
the same samples make a step at any world size, so a step lost with a rank is redone over the survivors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset

from lockstep.data import DistributedSampler, MicroBatchSampler
from lockstep.runtime.env.topology import Topology
from lockstep.runtime.micro_batches import owned_micro_batches
from lockstep.trainer.run.batches import BatchPlan
from lockstep.trainer.settings.config import FitConfig


class TrainData:
    """The training set as fit reads it, on this rank."""

    def __init__(
        self, data: Dataset, config: FitConfig, plan: BatchPlan, topo: Topology, *, pin: bool
    ) -> None:
        self.config, self.plan = config, plan
        self.micro_batched = plan.num_micro_batches > 0  # a step: K micro-batches through accumulate()
        # Its own generator, reseeded each epoch: otherwise iter(loader) draws worker seeds from the global
        # stream, and a resumed run (which calls iter() at another step) would shift every later draw.
        self.generator = torch.Generator()
        sized = cast(Sized, data)  # fit() checked that the datasets are map-style
        self.sampler: Any
        if self.micro_batched:
            self.sampler = MicroBatchSampler(
                sized, plan.micro_batch_size, plan.num_micro_batches, shuffle=True, seed=config.seed
            )
            self.loader = DataLoader(
                data,
                batch_sampler=self.sampler,
                num_workers=config.num_workers,
                generator=self.generator,
                pin_memory=pin,
            )
        else:
            self.sampler = DistributedSampler(sized, shuffle=True, seed=config.seed, drop_last=True)
            self.loader = DataLoader(
                data,
                batch_size=plan.micro_batch_size,
                sampler=self.sampler,
                num_workers=config.num_workers,
                drop_last=True,
                generator=self.generator,
                pin_memory=pin,
            )
        self.micro_per_step = self._micro_per_step(topo)
        # The loop tells the sampler what it consumed: with DataLoader workers, what the sampler yielded
        # runs ahead of what was trained on, and resume must continue after the last trained sample.
        self.sampler.advance(0)

    def _micro_per_step(self, topo: Topology) -> int:
        if self.micro_batched:
            return len(owned_micro_batches(self.plan.num_micro_batches, topo.world_size, topo.rank))
        return self.plan.micro_batches_per_rank

    def steps_in_epoch(self) -> int:
        """Optimizer steps of the epoch the sampler is set to (fewer after a mid-epoch resume)."""
        if isinstance(self.sampler, MicroBatchSampler):
            return self.sampler.num_steps()
        return math.ceil(len(self.loader) / self.micro_per_step)

    def start_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)  # resumes mid-epoch when the loaded state stopped there
        self.generator.manual_seed(self.config.seed * 1_000_003 + epoch)

    def iterate(self) -> tuple[Iterator[Any], int, int]:
        """(this rank's micro-batches for the rest of the epoch, steps left in it, micro-batches left)."""
        return iter(self.loader), self.steps_in_epoch(), len(self.loader)

    def reshard(self, topo: Topology) -> None:
        """The group changed (live mode): this rank's shard, from the position the sampler stands at."""
        state = self.sampler.state_dict()
        self.sampler.num_replicas, self.sampler.rank = topo.world_size, topo.rank
        self.sampler.load_state_dict(state)
        self.micro_per_step = self._micro_per_step(topo)
