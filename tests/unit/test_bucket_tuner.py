"""The bucket tuner's pure decisions (engine/buckets/bucket_tuner.py): which caps to try, in which order, which to keep."""

from __future__ import annotations

import functools
import time
import types

import pytest
import torch

from lockstep.engine.buckets.bucket_layout import ParamSpec, assign_buckets
from lockstep.engine.buckets.bucket_tuner import (
    CANDIDATE_CAPS_MB,
    BucketTuner,
    TuningPlan,
    choose_cap,
    distinct_caps,
    trial_order,
)
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.stats import StatsRecorder
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


class _Reducer:
    """What the tuner drives (bucket_tuner.Relayout), without a model: each step records a backward +
    finalize span of 1 ms, while the step itself (between pre_forwards) takes 20 ms."""

    rebuilt, step, group = True, None, None
    device = torch.device("cpu")

    def __init__(self, params: list) -> None:
        self.params, self.stats, self.caps = params, StatsRecorder(), [25 * MB]

    def layout_at(self, cap_bytes: int) -> list:
        return layout_of([MB // 2] * 8, cap_bytes)  # 4 MiB: 1 and 25 MiB differ

    def relayout(self, cap_bytes: int) -> None:
        self.caps.append(cap_bytes)

    def run_step(self) -> None:
        time.sleep(0.02)
        self.stats.record(0.0, 0.5, 0.0, 0.0, 0.5, 0)


def _tune(reducer: _Reducer, plan: TuningPlan) -> BucketTuner:
    tuner = BucketTuner(reducer, plan)  # type: ignore[arg-type]  # the fake has what the tuner reads
    # the decision all-reduces the timings over the ranks (tests/multiproc/test_bucket_tuning.py): here,
    # with no process group, the timings are the test's, kept as measured
    tuner._decide = lambda: setattr(tuner, "state", "done")  # type: ignore[method-assign]
    while tuner.state != "done":
        tuner.pre_forward()
        reducer.run_step()
    return tuner


@pytest.mark.parametrize("whole_steps", [False, True])
def test_whole_steps_time_from_one_pre_forward_to_the_next(whole_steps: bool) -> None:
    """On CUDA the backward + finalize span is the host's launch time: there (whole_steps) the tuner times
    whole steps between device synchronizations instead (on the CPU: the same clock, no synchronization)."""
    plan = TuningPlan(caps_mb=(1.0,), passes=1, warmup=1, measured=2, whole_steps=whole_steps)
    tuner = _tune(_Reducer([torch.zeros(1)]), plan)
    times = [ms for row in tuner.step_ms for ms in row]
    assert len(times) == 4 and tuner.stats()["bucket_timing"] == (
        "whole steps, device synchronized" if whole_steps else "backward + finalize"
    )
    if whole_steps:
        assert all(ms >= 19.0 for ms in times), times  # the 20 ms of each step
    else:
        assert times == [1.0] * 4  # the recorded span


def test_whole_steps_are_the_default_where_a_parameter_is_on_cuda() -> None:
    meta_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))  # no GPU needed to read a device
    assert BucketTuner(_Reducer([meta_cuda]), TuningPlan()).whole_steps  # type: ignore[arg-type]
    assert not BucketTuner(_Reducer([torch.zeros(1)]), TuningPlan()).whole_steps  # type: ignore[arg-type]
