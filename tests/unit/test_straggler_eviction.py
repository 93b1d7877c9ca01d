"""Straggler eviction's rule (runtime/straggler_eviction.py) on synthetic judgements: who is evicted, when,
and when nobody is. The end-to-end eviction in live mode is tests/cli/test_evict_stragglers.py."""

from __future__ import annotations

import pytest

from lockstep.errors import ConfigError
from lockstep.runtime.env.topology import evict_stragglers_from_env
from lockstep.runtime.straggler_eviction import StragglerEviction
from lockstep.runtime.straggler_reports import Assessment, StragglerPolicy


def _a(rank: int, factor: float, excess_ms: float = 20.0, reference: int = 0) -> Assessment:
    return Assessment(rank, reference, factor, excess_ms, "data loading", excess_ms, 10, 24)


def _eviction(world: int = 3, min_world: int = 2, factor: float = 1.5) -> tuple[StragglerEviction, list]:
    evicted: list[tuple[int, str]] = []
    policy = StragglerPolicy()
    return StragglerEviction(
        factor, world, min_world, lambda r, why: evicted.append((r, why)), policy
    ), evicted


def test_a_rank_over_the_factor_in_consecutive_judgements_is_evicted_once() -> None:
    eviction, evicted = _eviction()
    assert eviction.consider({1: _a(1, 1.1), 2: _a(2, 2.0)}) == []  # the first judgement: not yet
    [line] = eviction.consider({1: _a(1, 1.1), 2: _a(2, 2.1)})
    assert line.startswith(
        "evicting rank 2: a straggler: 2.1x the median rank's busy time (rank 0) over steps"
    )
    assert "+20.0 ms/step in data loading; --evict-stragglers 1.5" in line
    assert [r for r, _ in evicted] == [2] and evicted[0][1] in line
    assert eviction.consider({2: _a(2, 3.0)}) == [] and len(evicted) == 1  # one per generation


def test_a_judgement_under_the_factor_restarts_the_count() -> None:
    eviction, evicted = _eviction()
    eviction.consider({1: _a(1, 2.0)})
    eviction.consider({1: _a(1, 1.4)})  # a good window in between
    assert eviction.consider({1: _a(1, 2.0)}) == [] and evicted == []


def test_a_small_absolute_excess_is_not_a_straggler_however_large_the_factor() -> None:
    eviction, evicted = _eviction()
    for _ in range(4):
        eviction.consider({1: _a(1, 3.0, excess_ms=1.0)})  # 3x of a 0.5 ms step: jitter, not a straggler
    assert evicted == []


def test_the_slowest_of_two_due_ranks_is_the_one_evicted() -> None:
    eviction, evicted = _eviction(world=4)
    for _ in range(2):
        eviction.consider({1: _a(1, 1.8), 3: _a(3, 2.5)})
    assert [r for r, _ in evicted] == [3]


def test_no_eviction_below_the_min_world_said_once() -> None:
    eviction, evicted = _eviction(world=2, min_world=2)
    lines = [line for _ in range(4) for line in eviction.consider({1: _a(1, 2.0)})]
    assert evicted == []
    assert lines == [
        "rank 1 is 2.0x the faster rank's busy time, over --evict-stragglers 1.5, but is not evicted: "
        "1 ranks would remain, fewer than --min-world 2"
    ]


@pytest.mark.parametrize("raw", ["1", "0.5", "x", "-2"])
def test_the_worker_refuses_a_factor_not_above_1(raw: str) -> None:
    with pytest.raises(ConfigError, match="LOCKSTEP_EVICT_STRAGGLERS=.* is not a factor > 1"):
        evict_stragglers_from_env({"LOCKSTEP_EVICT_STRAGGLERS": raw})
    assert evict_stragglers_from_env({}) is None
    assert evict_stragglers_from_env({"LOCKSTEP_EVICT_STRAGGLERS": "2"}) == 2.0
