"""Sampler arithmetic without a process group: torch parity, world-size-independent order, exact resume."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from lockstep.data import DistributedSampler, EvalSampler, gather_eval, reduce_eval
from lockstep.data.eval_sampler import shard_bounds
from lockstep.data.sampler import epoch_order
from lockstep.errors import ConfigError


def _ranks(size: int, world: int, **kwargs: object) -> list[DistributedSampler]:
    return [DistributedSampler(range(size), num_replicas=world, rank=r, **kwargs) for r in range(world)]


@pytest.mark.parametrize("size,world", [(10, 1), (10, 3), (17, 4), (4, 4), (2, 3), (0, 2), (23, 5)])
@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (True, True), (False, False), (False, True)])
def test_a_fresh_epoch_is_exactly_torchs(size: int, world: int, shuffle: bool, drop_last: bool) -> None:
    for rank in range(world):
        ours = DistributedSampler(range(size), world, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        theirs = TorchSampler(range(size), world, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs) == ours.num_samples == theirs.num_samples
            assert ours.total_size == theirs.total_size


def test_global_batches_are_the_same_samples_for_every_world_size_with_the_same_global_batch() -> None:
    size, global_batch = 50, 6

    def global_batches(world: int) -> list[set[int]]:
        per_rank = [list(s) for s in _ranks(size, world, seed=3, drop_last=True)]
        b = global_batch // world
        steps = len(per_rank[0]) // b
        return [set().union(*(set(idx[i * b:(i + 1) * b]) for idx in per_rank)) for i in range(steps)]

    reference = global_batches(1)
    assert len(reference) == 8
    for world in (2, 3, 6):
        assert global_batches(world) == reference[: len(global_batches(world))]


def test_iterating_again_starts_the_next_epoch_and_set_epoch_wins() -> None:
    sampler = DistributedSampler(range(12), num_replicas=2, rank=1, seed=5)
    torch_sampler = TorchSampler(range(12), num_replicas=2, rank=1, seed=5)

    def torch_epoch(epoch: int) -> list[int]:
        torch_sampler.set_epoch(epoch)
        return list(torch_sampler)

    assert list(sampler) == torch_epoch(0)
    assert list(sampler) == torch_epoch(1)  # forgetting set_epoch no longer repeats the order
    assert sampler.epoch == 1
    sampler.set_epoch(7)
    assert list(sampler) == torch_epoch(7)
    sampler.set_epoch(7)  # set_epoch wins, even to repeat an epoch (torch's behaviour)
    assert list(sampler) == torch_epoch(7)
    # the tutorials' loop: set_epoch(e) before each epoch gives torch's sequence
    fresh = DistributedSampler(range(12), num_replicas=2, rank=1, seed=5)
    for epoch in range(3):
        fresh.set_epoch(epoch)
        assert list(fresh) == torch_epoch(epoch)


def _consume(samplers: list[DistributedSampler], per_rank: int) -> list[int]:
    """Pull `per_rank` indices from each rank's live iterator; the positions they cover, in global order."""
    iters = [iter(s) for s in samplers]
    pulled = [[next(it) for _ in range(per_rank)] for it in iters]
    return [pulled[r][j] for j in range(per_rank) for r in range(len(samplers))]


def _rest(samplers: list[DistributedSampler]) -> list[int]:
    remaining = [list(s) for s in samplers]
    return [idx[j] for j in range(len(remaining[0])) for idx in remaining]


@pytest.mark.parametrize("size", [10, 17, 23])
@pytest.mark.parametrize("old,new", [(2, 3), (2, 1), (3, 2), (1, 4), (2, 2), (4, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_any_world_size_yields_exactly_the_unseen_samples(size: int, old: int, new: int,
                                                                   drop_last: bool) -> None:
    order = epoch_order(size, seed=11, epoch=0, shuffle=True)
    for per_rank in range(0, size // old):
        before = _ranks(size, old, seed=11, drop_last=drop_last)
        seen = _consume(before, per_rank)
        state = json.loads(json.dumps(before[0].state_dict()))  # plain JSON data
        assert state["num_consumed"] == per_rank * old or state["epoch"] == 1
        after = _ranks(size, new, seed=11, drop_last=drop_last)
        for sampler in after:
            sampler.load_state_dict(state)
        rest = _rest(after) if after[0].epoch == 0 else []  # else nothing of epoch 0 is left
        sequence = seen + rest
        if drop_last:  # no duplicates, nothing seen twice; only a tail shorter than the world size is dropped
            assert sequence == order[: len(sequence)]
            assert size - len(sequence) < max(old, new)
        else:  # every sample at least once; duplicates only from wrapping past the end (torch's padding)
            assert sequence[:size] == order
            assert sequence[size:] == order[: len(sequence) - size]
            assert len(sequence) - size < max(old, new)


def test_a_resumed_epoch_is_followed_by_normal_epochs() -> None:
    before = _ranks(20, 2, seed=1)
    _consume(before, 4)
    state = before[0].state_dict()
    resumed = DistributedSampler(range(20), 3, 0, seed=1)
    resumed.load_state_dict(state)
    assert len(resumed) == 4  # ceil(12 / 3) still to go in this epoch
    assert len(list(resumed)) == 4
    reference = DistributedSampler(range(20), 3, 0, seed=1)
    reference.set_epoch(1)
    assert list(resumed) == list(reference)
    assert resumed.epoch == 1


def test_state_after_a_finished_epoch_points_at_the_next_one() -> None:
    sampler = DistributedSampler(range(9), num_replicas=2, rank=0)
    assert sampler.state_dict()["epoch"] == 0 and sampler.state_dict()["num_consumed"] == 0
    list(sampler)
    assert (sampler.state_dict()["epoch"], sampler.state_dict()["num_consumed"]) == (1, 0)
    # set_epoch(e) on the epoch a loaded state is inside keeps the resume position (the tutorials' loop)
    resumed = DistributedSampler(range(9), num_replicas=2, rank=0)
    resumed.load_state_dict({"epoch": 2, "num_consumed": 4})
    resumed.set_epoch(2)
    assert len(resumed) == 3 and resumed.num_consumed == 4
    resumed.set_epoch(3)
    assert len(resumed) == 5 and resumed.num_consumed == 0


def test_advance_counts_what_the_loop_consumed_not_what_was_prefetched() -> None:
    sampler = DistributedSampler(range(16), num_replicas=2, rank=0, seed=2)
    sampler.advance(0)  # explicit counting from the first batch on
    it = iter(sampler)
    for _ in range(6):
        next(it)  # a prefetching loader pulled 6 indices
    assert sampler.state_dict()["num_consumed"] == 0
    sampler.advance(4)  # the loop trained on one global batch of 2 x 2
    assert sampler.state_dict()["num_consumed"] == 4
    with pytest.raises(ConfigError, match="past the end of epoch 0"):
        sampler.advance(100)
    with pytest.raises(ConfigError, match="int >= 0"):
        sampler.advance(-1)


def test_bad_states_and_arguments_are_named() -> None:
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0, seed=1)
    with pytest.raises(ConfigError, match="dataset_len=12 but this sampler has dataset_len=10"):
        sampler.load_state_dict({**sampler.state_dict(), "dataset_len": 12})
    with pytest.raises(ConfigError, match="seed=4"):
        sampler.load_state_dict({**sampler.state_dict(), "seed": 4})
    with pytest.raises(ConfigError, match="'epoch' and 'num_consumed'"):
        sampler.load_state_dict({"epoch": 1})
    with pytest.raises(ConfigError, match=r"rank must be in \[0, 1\]"):
        DistributedSampler(range(10), num_replicas=2, rank=2)
    with pytest.raises(ConfigError, match="num_replicas"):
        DistributedSampler(range(10), num_replicas=0, rank=0)


def test_defaults_without_a_process_group_are_a_world_of_one() -> None:
    sampler = DistributedSampler(range(5), shuffle=False)
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, [0, 1, 2, 3, 4])


class _Squares(Dataset[int]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        return index


def test_dataloader_with_workers_resumes_exactly_with_advance() -> None:
    """Workers prefetch: the yielded count overshoots; advance() gives the exact count to resume from."""
    sampler = DistributedSampler(_Squares(), num_replicas=1, rank=0, seed=9)
    loader = DataLoader(_Squares(), batch_size=4, sampler=sampler, num_workers=2, prefetch_factor=2)
    seen: list[int] = []
    for batch in itertools.islice(loader, 3):
        seen += batch.tolist()
    prefetched = sampler.state_dict()["num_consumed"]
    assert prefetched > len(seen)  # what the default count says: more than the loop really got
    sampler.advance(len(seen))
    state = sampler.state_dict()
    assert state["num_consumed"] == 12
    resumed = DistributedSampler(_Squares(), num_replicas=1, rank=0, seed=9)
    resumed.load_state_dict(state)
    rest = [i for batch in DataLoader(_Squares(), batch_size=4, sampler=resumed, num_workers=2) for i in batch.tolist()]
    assert seen + rest == epoch_order(64, seed=9, epoch=0, shuffle=True)


@pytest.mark.parametrize("size,world", [(10, 3), (2, 3), (0, 2), (7, 7), (100, 8)])
def test_eval_shards_cover_every_sample_once_in_order(size: int, world: int) -> None:
    shards = [list(EvalSampler(range(size), num_replicas=world, rank=r)) for r in range(world)]
    assert sum(shards, []) == list(range(size))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shard_bounds(size, world)[-1] == size
    assert Counter(map(len, shards))[0] == max(world - size, 0)


def test_gather_and_reduce_in_a_world_of_one() -> None:
    values = [torch.tensor([3.0, 1.0]), torch.tensor([2.0])]
    assert torch.equal(gather_eval(values, indices=[torch.tensor([2, 0]), torch.tensor([1])]),
                       torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ConfigError, match="index 1 was evaluated more than once"):
        gather_eval(torch.zeros(2), indices=torch.tensor([1, 1]))
    assert reduce_eval({"correct": 3, "loss": torch.tensor(0.5)}) == {"correct": 3, "loss": 0.5}
