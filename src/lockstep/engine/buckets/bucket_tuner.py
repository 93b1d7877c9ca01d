"""Bucket size chosen by measurement (SyncPolicy(bucket_cap_mb="auto")): try a few caps, keep the fastest.

After the reducer's rebuild (rank 0's ready order, reducer.py) the tuner lays the buckets out again at a
few candidate caps (CANDIDATE_CAPS_MB, pruned to those that give distinct layouts for this model), each
for `warmup` + `measured` synced steps, in `passes` passes that alternate direction (A B C, then C B A:
a drift over the trials, warm-up of the process or a neighbour's load, falls on every candidate alike).
Then every rank all-reduces the timings (max over ranks: a step takes its slowest rank's time) and
decides with the same pure function on the same numbers, so every rank adopts the same layout with no
further message. The default cap (25 MiB, torch's) stays unless another is faster by more than `margin`.

What is timed: each step's backward + finalize span (StepStats.backward_ms + finalize_ms), from the
gradient reaching the outputs to the averages back in `.grad`. That is all the bucket size changes: how
early the first all-reduce starts, how much backward is slowed by launches and copies (and, on CPU, by
the collectives competing for the cores), and the communication left exposed at the end. The exposed
wait alone (comm_ms - comm_hidden_ms) would miss the second: small buckets hide more communication but
may slow backward more. The forward does not depend on the buckets.

On CUDA the host's clock sees kernel launches, not the work: backward returns, and NCCL's waits return,
once the kernels are queued on the device, so that span would time how fast the host queues them, about
the same for every cap. There (`TuningPlan.whole_steps`, on by default where a parameter is on CUDA) the
tuner times whole steps instead, from one device synchronization to the next, at each synced pre_forward
while it measures: the forward, the optimizer step and any no_sync micro-step between add the same to
every candidate; the synchronizations cost the measured steps only.

A warm-up step after each relayout is not counted: the new buffers are allocated, and the fast hooks
(fast_hooks.py) are chosen for the old buckets until that step ends. Relayouts happen in pre_forward,
between steps, outside join() (a joined rank runs no forward; the tuner waits for the context to close).
At two ranks the layout cannot change the bits (each sum has two terms, and float addition commutes);
at more, a ring all-reduce's order of summation depends on where an element sits in its bucket, so
results may differ in the last bits, as between any two bucket sizes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.engine.buckets.bucket_layout import BucketSpec
from lockstep.engine.core.bucket_settings import DEFAULT_BUCKET_CAP_MB
from lockstep.engine.core.stats import StatsRecorder

CANDIDATE_CAPS_MB = (1.0, 4.0, 10.0, 25.0, 50.0, 100.0)
MIB = 1024 * 1024


@dataclass(frozen=True)
class TuningPlan:
    """Which caps the tuner tries (MiB) and how many steps it spends: per candidate and pass, `warmup`
    uncounted then `measured` timed. With the defaults and six distinct caps: 36 steps."""

    caps_mb: tuple[float, ...] = CANDIDATE_CAPS_MB
    passes: int = 2
    warmup: int = 1
    measured: int = 2
    margin: float = 0.03  # leave the default only for a gain above the noise floor (2-4% on loaded CPUs)
    whole_steps: bool | None = None  # time whole steps between device synchronizations (None: on CUDA)

    @property
    def per_trial(self) -> int:
        return self.warmup + self.measured


# ---------------------------------------------------------------- the pure decisions


def distinct_caps(
    layout_at: Callable[[int], Sequence[BucketSpec]],
    caps_mb: Sequence[float] = CANDIDATE_CAPS_MB,
    default_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> list[float]:
    """The caps worth trying, ascending: one per distinct layout (`layout_at(cap_bytes)`), the default
    always among them. Of caps that give the same buckets, the one nearest the default (by ratio) stays:
    on a model of 8 MiB, 25, 50 and 100 MiB are one bucket, reported as 25."""
    by_closeness = sorted({*caps_mb, default_mb}, key=lambda c: (max(c, default_mb) / min(c, default_mb), c))
    kept: dict[tuple[tuple[int, ...], ...], float] = {}
    for cap in by_closeness:
        key = tuple(spec.param_indices for spec in layout_at(int(cap * MIB)))
        kept.setdefault(key, cap)
    return sorted(kept.values())


def trial_order(num_candidates: int, passes: int) -> list[int]:
    """Candidate indices in the order tried: ascending, then descending, alternating per pass."""
    forward = list(range(num_candidates))
    return [i for p in range(passes) for i in (forward if p % 2 == 0 else forward[::-1])]


def choose_cap(
    caps_mb: Sequence[float],
    step_ms: Sequence[Sequence[float]],
    *,
    default_mb: float = DEFAULT_BUCKET_CAP_MB,
    margin: float = 0.03,
) -> tuple[float, str]:
    """The cap to keep and why, from each candidate's step times (0 or less: not measured).

    The fastest by median; the default unless the fastest beats it by more than `margin` (a fraction).
    Every rank calls this with the same all-reduced numbers and so decides the same.
    """
    medians = {cap: _median(times) for cap, times in zip(caps_mb, step_ms)}
    timed = {cap: m for cap, m in medians.items() if m is not None}
    if not timed:
        return default_mb, "no step was timed: kept the default"
    default = timed.pop(default_mb, None)
    if not timed:
        return default_mb, f"the default: {default:.3f} ms, no other cap timed"
    best = min(timed, key=lambda cap: (timed[cap], cap))  # the fastest other than the default
    if default is None:
        return best, f"fastest median {timed[best]:.3f} ms (the default was not timed)"
    if timed[best] >= default * (1.0 - margin):
        return default_mb, (
            f"the default: {default:.3f} ms; the fastest other, {best:g} MiB at {timed[best]:.3f} ms, is "
            f"not {margin:.0%} faster"
        )
    return best, f"{timed[best]:.3f} ms against the default's {default:.3f} ms ({timed[best] / default:.3f})"


def _median(times: Sequence[float]) -> float | None:
    measured = [t for t in times if t > 0]
    return statistics.median(measured) if measured else None


# ---------------------------------------------------------------- driving the reducer


class Relayout(Protocol):
    """What the tuner needs of the reducer (reducer.py)."""

    rebuilt: bool
    stats: StatsRecorder
    group: dist.ProcessGroup | None
    device: torch.device

    @property
    def params(self) -> Sequence[torch.Tensor]:
        """The replica's parameters (the tuner reads their devices)."""
        ...

    @property
    def step(self) -> Any:
        """The step under way (None between steps)."""
        ...

    def layout_at(self, cap_bytes: int) -> list[BucketSpec]:
        """The buckets the rebuild's order gives at `cap_bytes`, without building them."""
        ...

    def relayout(self, cap_bytes: int) -> None:
        """Build the buckets again at `cap_bytes`, in the rebuild's order."""
        ...


class BucketTuner:
    """Tries the candidate caps over the first synced steps after the rebuild and keeps the fastest."""

    def __init__(self, reducer: Relayout, plan: TuningPlan | None = None) -> None:
        self.reducer, self.plan = reducer, plan or TuningPlan()
        self.cap_mb = DEFAULT_BUCKET_CAP_MB  # the cap of the buckets now
        self.state = "waiting for the rebuild"  # -> measuring -> done
        self.caps: list[float] = []
        self.step_ms: list[list[float]] = []  # per candidate: its timed steps (max over ranks once done)
        self.num_buckets: list[int] = []
        self.reason = ""
        self._order: list[int] = []  # candidate index per trial
        self._calls = 0  # synced pre_forwards since measuring began
        self._seen_steps = 0  # the reducer's recorded steps at the last call
        self._cuda = sorted({p.device for p in reducer.params if p.device.type == "cuda"}, key=str)
        self._t_mark = 0.0  # whole steps: when the device was last synchronized (perf_counter)

    def pre_forward(self) -> None:
        """pre_forward of a synced step (outside join()), after the rebuild's chance: count the step that
        just ended, and lay the buckets out for the next trial, or for good once every trial is timed."""
        if self.state == "done" or not self.reducer.rebuilt or self.reducer.step is not None:
            return
        now = self._clock()  # the step that just ended, done on the device too (whole steps)
        if self.state != "measuring":
            self._start()
            if self.state == "done":
                return
        self._count_last_step(now)
        per_trial = self.plan.per_trial
        if self._calls == len(self._order) * per_trial:
            self._decide()
            return
        if self._calls % per_trial == 0:
            self._use(self.caps[self._order[self._calls // per_trial]])
        self._calls += 1
        if self.whole_steps:
            self._t_mark = self._clock()  # after the relayout: its allocations are not the next step's

    @property
    def whole_steps(self) -> bool:
        """Whether whole steps are timed between device synchronizations (module doc): on CUDA by default."""
        return bool(self._cuda) if self.plan.whole_steps is None else self.plan.whole_steps

    def _clock(self) -> float:
        """perf_counter, once every CUDA device of the replica has finished its queued work (whole steps)."""
        if self.whole_steps:
            for device in self._cuda:
                torch.cuda.synchronize(device)
        return time.perf_counter()

    def _start(self) -> None:
        self.caps = distinct_caps(self.reducer.layout_at, self.plan.caps_mb)
        self.num_buckets = [len(self.reducer.layout_at(int(cap * MIB))) for cap in self.caps]
        self.step_ms = [[] for _ in self.caps]
        self._seen_steps = self.reducer.stats.steps
        if len(self.caps) < 2:
            self.state, self.reason = "done", "every candidate cap gives the same buckets for this model"
            return
        self.state, self._order = "measuring", trial_order(len(self.caps), self.plan.passes)

    def _count_last_step(self, now: float) -> None:
        """The step since the last call ran under trial (calls - 1): count it unless it warmed up."""
        recorder = self.reducer.stats
        fresh, self._seen_steps = recorder.steps > self._seen_steps, recorder.steps
        done = self._calls - 1
        if done < 0 or done % self.plan.per_trial < self.plan.warmup:
            return
        last = recorder.last
        if self.whole_steps:
            span = (now - self._t_mark) * 1000.0 if fresh else 0.0
        else:
            span = last.backward_ms + last.finalize_ms if fresh and last is not None else 0.0
        self.step_ms[self._order[done // self.plan.per_trial]].append(span)  # 0.0: no backward ran

    def _decide(self) -> None:
        """Every rank: the timings' max over ranks, then the same choice from the same numbers."""
        width = self.plan.passes * self.plan.measured
        rows = [times + [0.0] * (width - len(times)) for times in self.step_ms]
        table = torch.tensor(rows, dtype=torch.float64, device=self.reducer.device)  # the group's device
        if dist.get_world_size(self.reducer.group) > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.reducer.group)
        self.step_ms = [[float(t) for t in row] for row in table.cpu()]
        cap, self.reason = choose_cap(self.caps, self.step_ms, margin=self.plan.margin)
        self._use(cap)
        self.state = "done"

    def _use(self, cap_mb: float) -> None:
        if cap_mb != self.cap_mb:
            self.reducer.relayout(int(cap_mb * MIB))
            self.cap_mb = cap_mb

    def stats(self) -> dict[str, Any]:
        """For EngineStats.extras: the cap now, how the tuning stands, every candidate's timed steps."""
        return {
            "bucket_cap_mb": self.cap_mb,
            "bucket_tuning": self.state,
            "bucket_tuning_reason": self.reason,
            "bucket_timing": "whole steps, device synchronized"
            if self.whole_steps
            else "backward + finalize",
            "bucket_trials": [
                {
                    "cap_mb": cap,
                    "num_buckets": n,
                    "step_ms": list(times),
                    "median_ms": _median(times),
                }
                for cap, n, times in zip(self.caps, self.num_buckets, self.step_ms)
            ],
        }
