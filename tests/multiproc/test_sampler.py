"""DistributedSampler on real gloo ranks: stop mid-epoch at world size 2, resume at 3 (and 1) on exactly the unseen samples.

The first part's loader prefetches with a worker process, so the loop tells the sampler what it really consumed with
advance(); the global batches after the resume are the uninterrupted run's, since N * b stays 6.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from lockstep.data import DistributedSampler
from lockstep.runtime import get_world_size
from lockstep.testing import run_distributed

SIZE, GLOBAL_BATCH, SEED = 60, 6, 5


class _Indices(Dataset[int]):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> int:
        return index


def _loader(sampler: DistributedSampler, workers: int = 0) -> DataLoader[int]:
    batch = GLOBAL_BATCH // sampler.num_replicas
    if workers == 0:
        return DataLoader(_Indices(), batch_size=batch, sampler=sampler)
    return DataLoader(_Indices(), batch_size=batch, sampler=sampler, num_workers=workers, prefetch_factor=2)


def _train_part(steps: int) -> tuple[list[list[int]], dict[str, Any], int]:
    sampler = DistributedSampler(_Indices(), seed=SEED)  # rank and world from the process group
    sampler.advance(0)  # count what the loop consumes, not what the worker prefetched
    batches = []
    for batch in itertools.islice(_loader(sampler, workers=1), steps):
        batches.append(batch.tolist())
        sampler.advance(len(batch) * get_world_size())
    return batches, sampler.state_dict(), sampler._yielded * get_world_size()


def _resume_part(state: dict[str, Any]) -> tuple[list[list[list[int]]], list[int], list[int], int]:
    sampler = DistributedSampler(_Indices(), seed=SEED)
    sampler.load_state_dict(state)
    loader = _loader(sampler)
    epochs = []
    for epoch in range(2):  # rest of epoch 0 (set_epoch of the loaded epoch keeps its position), then epoch 1
        sampler.set_epoch(epoch)
        epochs.append([batch.tolist() for batch in loader])
    uneven = DistributedSampler(_Indices(), seed=SEED, drop_last=False)
    uneven.load_state_dict({**state, "num_consumed": 52})  # 8 left: 3 ranks do not divide them
    shard = list(uneven)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = list(uneven)  # no set_epoch: epoch 0 again, whole and from its start, as torch
    return epochs, shard, again, sum("second full pass" in str(w.message) for w in caught)


def _global_batches(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Step i's samples over all ranks, sorted (a global batch is a set)."""
    return [sorted(sum((batches[i] for batches in per_rank), [])) for i in range(len(per_rank[0]))]


def _uninterrupted(world: int, epoch: int) -> list[list[int]]:
    samplers = [DistributedSampler(_Indices(), num_replicas=world, rank=r, seed=SEED) for r in range(world)]
    batch = GLOBAL_BATCH // world
    per_rank = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        indices = list(sampler)
        per_rank.append([indices[i : i + batch] for i in range(0, len(indices), batch)])
    return _global_batches(per_rank)


def test_stop_at_two_ranks_resume_at_three_and_one_on_the_same_global_batches() -> None:
    first = run_distributed(_train_part, 2, args=(4,), timeout=90)
    states = [state for _, state, _ in first]
    assert states[0] == states[1]
    assert states[0]["epoch"] == 0 and states[0]["num_consumed"] == 4 * GLOBAL_BATCH
    assert all(yielded > 4 * GLOBAL_BATCH for _, _, yielded in first)  # the worker ran ahead of the loop
    seen = _global_batches([batches for batches, _, _ in first])
    reference = [_uninterrupted(2, 0), _uninterrupted(2, 1)]
    assert seen == reference[0][:4]

    resumed = run_distributed(_resume_part, 3, args=(states[0],), timeout=90)
    rest, next_epoch = (_global_batches([r[e] for r, *_ in resumed]) for e in (0, 1))
    assert rest == reference[0][4:]  # exactly the unseen samples, in the same global batches
    assert sorted(sum(seen + rest, [])) == list(range(SIZE))  # each sample once: nothing lost or repeated
    assert next_epoch == reference[1]

    single = DistributedSampler(_Indices(), seed=SEED)  # this process: a world of one
    single.load_state_dict(states[0])
    assert _global_batches([[b.tolist() for b in _loader(single)]]) == reference[0][4:]

    _check_padding([shard for _, shard, _, _ in resumed])
    for rank, (_, _, again, warned) in enumerate(resumed):
        torch_sampler = TorchSampler(_Indices(), num_replicas=3, rank=rank, seed=SEED)
        assert again == list(torch_sampler)
        assert warned == (1 if rank == 0 else 0)  # the repeated epoch is named once, by rank 0 only


def _check_padding(shards: list[list[int]]) -> None:
    """8 samples left over 3 ranks: one padded position, taken from the epoch's start as torch pads."""
    order = torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED)).tolist()
    assert [len(s) for s in shards] == [3, 3, 3]
    positions = [shards[r][j] for j in range(3) for r in range(3)]
    assert positions == order[52:] + order[:1]
