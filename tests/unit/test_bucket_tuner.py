"""The bucket tuner's pure decisions (engine/bucket_tuner.py): which caps to try, in which order, which to keep."""

from __future__ import annotations

import functools

import pytest

from lockstep.engine.bucket_layout import ParamSpec, assign_buckets
from lockstep.engine.bucket_tuner import CANDIDATE_CAPS_MB, TuningPlan, choose_cap, distinct_caps, trial_order
from lockstep.engine.policy import SyncPolicy
from lockstep.errors import ConfigError

MB = 1024 * 1024


def layout_of(sizes: list[int], cap_bytes: int) -> list:
    params = [ParamSpec(f"p{i}", n // 4, n, "cpu", "float32") for i, n in enumerate(sizes)]
    return assign_buckets(params, cap_bytes=cap_bytes, first_cap_bytes=min(MB, cap_bytes), solo_bytes=4 * MB)


def test_caps_that_give_the_same_buckets_are_tried_once_as_the_one_nearest_the_default() -> None:
    small = functools.partial(
        layout_of, [MB // 4] * 32
    )  # 8 MiB: 10, 25, 50 and 100 MiB are one bucket after the first
    assert distinct_caps(small) == [1.0, 4.0, 25.0]
    big = functools.partial(layout_of, [MB // 2] * 400)  # 200 MiB: every cap is distinct
    assert distinct_caps(big) == list(CANDIDATE_CAPS_MB)
    tiny = functools.partial(layout_of, [1000] * 10)  # 10 kB: one bucket whatever the cap
    assert distinct_caps(tiny) == [25.0]


def test_the_default_is_always_a_candidate() -> None:
    big = functools.partial(layout_of, [MB // 2] * 400)
    assert distinct_caps(big, (1.0, 100.0)) == [1.0, 25.0, 100.0]


def test_passes_alternate_direction() -> None:
    assert trial_order(3, 2) == [0, 1, 2, 2, 1, 0]
    assert trial_order(2, 3) == [0, 1, 1, 0, 0, 1]
    assert TuningPlan().per_trial == 3


def test_choose_keeps_the_default_unless_another_is_faster_by_more_than_the_margin() -> None:
    caps = [1.0, 4.0, 25.0]
    assert choose_cap(caps, [[10.0, 10.2], [9.0, 9.1], [10.0, 10.0]])[0] == 4.0
    cap, why = choose_cap(caps, [[10.0, 10.2], [9.8, 9.9], [10.0, 10.0]])  # 1.5% faster: noise
    assert cap == 25.0 and "not 3% faster" in why
    assert choose_cap(caps, [[9.8, 9.9], [9.0, 9.1], [10.0, 10.0]], margin=0.0)[0] == 4.0


def test_choose_takes_the_median_and_ignores_steps_not_timed() -> None:
    caps = [1.0, 25.0]
    # one spike (50 ms) does not disqualify 1 MiB: the median of 8, 8, 50 is 8
    assert choose_cap(caps, [[8.0, 50.0, 8.0], [10.0, 10.0, 10.0]])[0] == 1.0
    # a step no rank timed (0.0: no backward followed the forward) is left out
    assert choose_cap(caps, [[0.0, 8.0], [10.0, 0.0]])[0] == 1.0
    assert choose_cap(caps, [[0.0], [0.0]]) == (25.0, "no step was timed: kept the default")


def test_ties_go_to_the_smaller_cap_and_the_decision_is_a_function_of_the_numbers() -> None:
    caps = [1.0, 4.0, 25.0]
    times = [[5.0], [5.0], [10.0]]
    assert choose_cap(caps, times) == choose_cap(list(caps), [list(t) for t in times])
    assert choose_cap(caps, times)[0] == 1.0


def test_auto_is_refused_where_there_are_no_lockstep_buckets_to_time() -> None:
    assert SyncPolicy(bucket_cap_mb="auto").tune_buckets
    assert SyncPolicy(bucket_cap_mb="auto").bucket_cap_bytes == 25 * MB  # until the tuner chooses
    assert not SyncPolicy().tune_buckets
    for kwargs in ({"torch_bucket_layout": True}, {"deterministic": True}, {"sync": "local_sgd"}):
        with pytest.raises(ConfigError, match="bucket_cap_mb='auto'"):
            SyncPolicy(bucket_cap_mb="auto", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="positive number of MiB or 'auto'"):
        SyncPolicy(bucket_cap_mb="fast")


def test_the_reason_names_the_fastest_other_cap_when_the_default_stays() -> None:
    cap, why = choose_cap([1.0, 4.0, 25.0], [[12.0], [11.0], [10.0]])
    assert cap == 25.0 and "the fastest other, 4 MiB at 11.000 ms" in why
    assert choose_cap([25.0], [[10.0]]) == (25.0, "the default: 10.000 ms, no other cap timed")
