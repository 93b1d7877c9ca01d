"""Shard an evaluation set so that every sample is seen by exactly one rank, with no padding.

torch's DistributedSampler pads the last shard with duplicates (pytorch/pytorch#25162), which biases
metrics. `EvalSampler` gives rank r the contiguous block [bounds(r), bounds(r+1)): shard sizes differ by
at most one, a rank may get none (fewer samples than ranks), and the blocks concatenated in rank order
are the dataset in order. Unequal shards are safe because nothing here communicates per batch: evaluate
the bare module (model.module), not a wrapper whose forward may synchronize buffers, then combine the
results once with `gather()` (per-sample rows) or `lockstep.data.reduce_eval` (sums and counts).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Sized

import torch
from torch.utils.data import Sampler

from lockstep.data.gather import gather_eval
from lockstep.data.sampler import resolve_replicas


def shard_bounds(num_samples: int, num_replicas: int) -> list[int]:
    """Block boundaries: rank r evaluates positions [bounds[r], bounds[r + 1]); the first ranks get the extra."""
    base, extra = divmod(num_samples, num_replicas)
    return [r * base + min(r, extra) for r in range(num_replicas + 1)]


class EvalSampler(Sampler[int]):
    """Every index of `dataset` exactly once over all ranks, in order, unequal shard sizes allowed."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None) -> None:
        self.dataset = dataset
        self.num_replicas, self.rank = resolve_replicas(num_replicas, rank)

    def _bounds(self) -> tuple[int, int]:
        bounds = shard_bounds(len(self.dataset), self.num_replicas)
        return bounds[self.rank], bounds[self.rank + 1]

    def __iter__(self) -> Iterator[int]:
        return iter(range(*self._bounds()))

    def __len__(self) -> int:
        first, last = self._bounds()
        return last - first

    def indices(self) -> list[int]:
        """This rank's dataset indices, in the order it yields them."""
        return list(self)

    def gather(
        self,
        values: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Every rank's per-sample rows (in the loader's order), as one tensor in dataset order, on every rank.

        `values` are this rank's outputs (a tensor, a list of per-batch tensors, or a dict of either) with
        one row per sample of this shard; a rank with an empty shard passes an empty list. The result equals
        what a single process evaluating the whole dataset in order would have collected. A collective:
        every rank calls it.
        """
        return gather_eval(
            values, indices=torch.tensor(self.indices(), dtype=torch.int64), num_samples=len(self.dataset)
        )
