"""Sampler arithmetic without a process group: torch parity, world-size-independent order, exact resume."""

from __future__ import annotations

import itertools
import json
import warnings
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
        return [set().union(*(set(idx[i * b : (i + 1) * b]) for idx in per_rank)) for i in range(steps)]

    reference = global_batches(1)
    assert len(reference) == 8
    for world in (2, 3, 6):
        assert global_batches(world) == reference[: len(global_batches(world))]


# A program's calls, replayed on lockstep's sampler and on torch's: ("set", e) is set_epoch(e), ("iter",)
# one full iteration, ("peek",) one index taken from a fresh iterator (a loop peeking at its first batch).
PROGRAMS = {
    "no_set_epoch": [("iter",), ("iter",), ("iter",)],
    "peek_then_train": [("set", 3), ("peek",), ("iter",), ("set", 4), ("peek",), ("iter",)],
    "tutorial_peek_before_set_epoch": [("peek",), ("set", 0), ("iter",), ("peek",), ("set", 1), ("iter",)],
    "set_then_iterate_twice": [("set", 3), ("iter",), ("iter",)],
    "epochs_0_1_2": [("set", 0), ("iter",), ("set", 1), ("iter",), ("set", 2), ("iter",)],
    "epochs_2_0_5": [("set", 2), ("iter",), ("set", 0), ("iter",), ("set", 5), ("iter",)],
    "same_epoch_each_time": [("set", 1), ("iter",), ("set", 1), ("iter",)],
}


def _replay(sampler: DistributedSampler | TorchSampler, program: list[tuple]) -> list[object]:
    """What the program sees: len() before every step and the indices each step yields."""
    seen: list[object] = []
    for step in program:
        seen.append(len(sampler))
        if step[0] == "set":
            sampler.set_epoch(step[1])
        elif step[0] == "peek":
            seen.append(next(iter(sampler), None))
        else:
            seen.append(list(sampler))
        seen.append(sampler.epoch)
    return seen


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (True, True), (False, False), (False, True)])
def test_any_sequence_of_set_epoch_calls_gives_torchs_order(
    world: int, program: str, shuffle: bool, drop_last: bool
) -> None:
    for size in (1, 7, 10, 13):  # 7, 10 and 13 do not divide by 3 or 4; 1 is fewer samples than ranks
        for rank in range(world):
            ours = DistributedSampler(range(size), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            theirs = TorchSampler(range(size), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the repeated-epoch warning has its own tests
                assert _replay(ours, PROGRAMS[program]) == _replay(theirs, PROGRAMS[program])
            assert len(ours) == len(theirs) == ours.num_samples == theirs.num_samples


REPEATED = "second full pass ran with epoch number"


def _repeat_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if REPEATED in str(w.message)]


def test_repeating_an_epoch_warns_once_on_rank_0() -> None:
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0, seed=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = list(sampler)
    assert _repeat_warnings(record) == []
    with pytest.warns(
        UserWarning, match=r"epoch number 0 .*repeated epoch 0's order.*set_epoch\(epoch\)"
    ) as caught:
        assert list(sampler) == first  # torch's behaviour: the same order again
    assert len(_repeat_warnings(caught.list)) == 1
    assert caught.list[0].filename == __file__  # points at the code that pulled the indices
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        list(sampler)
        sampler.set_epoch(4)
        list(sampler)
        sampler.set_epoch(4)
        list(sampler)
    assert _repeat_warnings(record) == []  # once per sampler


def test_repeating_the_same_set_epoch_warns_too() -> None:
    sampler = DistributedSampler(range(10), num_replicas=1, rank=0)
    sampler.set_epoch(3)
    list(sampler)
    sampler.set_epoch(3)
    with pytest.warns(UserWarning, match="epoch number 3"):
        list(sampler)


def _warnings_of(program: list[tuple], **kwargs: object) -> list[str]:
    sampler = DistributedSampler(range(12), **{"num_replicas": 2, "rank": 0, **kwargs})  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _replay(sampler, program)
    return _repeat_warnings(record)


def test_no_repeated_epoch_warning_where_nothing_is_wrong() -> None:
    for name in ("epochs_0_1_2", "epochs_2_0_5", "peek_then_train", "tutorial_peek_before_set_epoch"):
        assert _warnings_of(PROGRAMS[name]) == [], name  # a peek is no pass over the epoch
    for name in ("no_set_epoch", "same_epoch_each_time"):
        assert len(_warnings_of(PROGRAMS[name])) == 1, name
        assert _warnings_of(PROGRAMS[name], rank=1) == [], name  # rank 0 speaks for all ranks
        assert _warnings_of(PROGRAMS[name], shuffle=False) == [], name  # no shuffle: every epoch is the same
    eval_sampler = EvalSampler(range(12), num_replicas=2, rank=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert [list(eval_sampler) for _ in range(3)] == [list(range(6))] * 3
    assert record == []


def test_a_loader_that_never_calls_set_epoch_warns_through_the_dataloader() -> None:
    sampler = DistributedSampler(range(10), num_replicas=1, rank=0, seed=3)
    loader = DataLoader(range(10), batch_size=4, sampler=sampler, drop_last=True)
    first = [batch.tolist() for batch in loader]
    with pytest.warns(UserWarning, match=REPEATED):
        assert [batch.tolist() for batch in loader] == first


def test_a_resumed_epoch_iterated_again_is_the_whole_epoch_in_torchs_order() -> None:
    before = _ranks(20, 2, seed=1)
    seen = _consume(before, 3)
    state = before[0].state_dict()
    assert (state["epoch"], state["num_consumed"]) == (0, 6)
    after = _ranks(20, 3, seed=1)
    for sampler in after:
        sampler.load_state_dict(state)
    assert seen + _rest(after) == epoch_order(20, seed=1, epoch=0, shuffle=True)[:18] + [
        epoch_order(20, seed=1, epoch=0, shuffle=True)[i] for i in (18, 19, 0)
    ]  # 14 left on 3 ranks: 1 padded
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for rank, sampler in enumerate(after):
            assert sampler.epoch == 0
            assert list(sampler) == list(
                TorchSampler(range(20), 3, rank, seed=1)
            )  # from position 0, as torch
    assert (
        len(_repeat_warnings(record)) == 1
    )  # the resumed pass and this one both ran epoch 0 (rank 0 says so)


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
def test_resume_at_any_world_size_yields_exactly_the_unseen_samples(
    size: int, old: int, new: int, drop_last: bool
) -> None:
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


def test_a_resumed_epoch_is_followed_by_the_epochs_set_next() -> None:
    before = _ranks(20, 2, seed=1)
    _consume(before, 4)
    state = before[0].state_dict()
    resumed = DistributedSampler(range(20), 3, 0, seed=1)
    resumed.load_state_dict(state)
    assert len(resumed) == 4  # ceil(12 / 3) still to go in this epoch
    assert len(list(resumed)) == 4
    assert resumed.state_dict()["epoch"] == 1  # the loop's next epoch
    reference = TorchSampler(range(20), 3, 0, seed=1)
    resumed.set_epoch(1)
    reference.set_epoch(1)
    assert len(resumed) == len(reference)
    assert list(resumed) == list(reference)
    assert resumed.epoch == 1


def _position(sampler: DistributedSampler) -> tuple[int, int]:
    state = sampler.state_dict()
    return state["epoch"], state["num_consumed"]


def test_state_before_during_and_after_an_iteration() -> None:
    sampler = DistributedSampler(range(9), num_replicas=2, rank=0)
    assert _position(sampler) == (0, 0)  # nothing iterated: the epoch's start
    sampler.set_epoch(4)
    assert _position(sampler) == (4, 0)
    it = iter(sampler)
    next(it), next(it)
    assert _position(sampler) == (4, 4)  # in progress: what was consumed
    list(it)
    assert _position(sampler) == (5, 0)  # finished: the loop goes on with the next epoch
    assert sampler.epoch == 4 and len(sampler) == 5  # but iter() alone repeats epoch 4, as torch
    again = iter(sampler)
    next(again)
    assert _position(sampler) == (4, 2)  # a repeated epoch counts from its start again
    sampler.set_epoch(5)
    assert _position(sampler) == (5, 0)
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
    rest = [
        i
        for batch in DataLoader(_Squares(), batch_size=4, sampler=resumed, num_workers=2)
        for i in batch.tolist()
    ]
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
    assert torch.equal(
        gather_eval(values, indices=[torch.tensor([2, 0]), torch.tensor([1])]), torch.tensor([1.0, 2.0, 3.0])
    )
    with pytest.raises(ConfigError, match="index 1 was evaluated more than once"):
        gather_eval(torch.zeros(2), indices=torch.tensor([1, 1]))
    assert reduce_eval({"correct": 3, "loss": torch.tensor(0.5)}) == {"correct": 3, "loss": 0.5}
