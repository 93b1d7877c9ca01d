"""Straggler detection on synthetic windows (runtime/straggler_reports.py), and the phase clock that feeds it.

The windows are built step by step through a real PhaseClock (with its time source replaced by a counter of
our own), so what is judged is exactly what a rank would publish: balanced ranks with CPU jitter name
nobody, one rank +30 ms per step in data loading is named with that phase, short spikes name nobody.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

import pytest

from lockstep.runtime import phase_clock
from lockstep.runtime.phase_clock import WINDOW, PhaseClock
from lockstep.runtime.straggler_reports import StragglerLog, assess

DATA, FORWARD, BACKWARD, OPT = "data loading", "forward", "backward", "optimizer"


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock_time(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTime]:
    fake = FakeTime()
    monkeypatch.setattr(phase_clock, "perf_counter", fake)
    yield fake


def _ranks_run(t: FakeTime, world: int, steps: int, busy: Any, seed: int = 0) -> list[dict[str, Any] | None]:
    """`world` ranks in lockstep: each step, each rank spends busy(rank, step, phase) seconds in data loading,
    forward, backward and optimizer; the all-reduce at the end of backward makes every rank wait until the
    slowest arrives. Returns each rank's summary of its last WINDOW steps."""
    rng = random.Random(seed)
    clocks = []
    for _ in range(world):
        clocks.append(PhaseClock("startup"))
    starts = [t.now] * world
    for step in range(1, steps + 1):
        arrive = []
        for rank, clock in enumerate(clocks):
            t.now = starts[rank]
            clock.close_step(step - 1)
            for name in (DATA, FORWARD, BACKWARD):
                clock.switch(name)
                t.now += busy(rank, step, name) * (1 + rng.uniform(-0.1, 0.1))
            arrive.append(t.now)
        done = max(arrive) + 0.0005  # the all-reduce itself
        for rank, clock in enumerate(clocks):
            t.now = arrive[rank]
            clock.begin_wait()
            t.now = done
            clock.end_wait()
            clock.switch(OPT)
            t.now += busy(rank, step, OPT)
            clock.switch("between steps")
            starts[rank] = t.now
    for rank, clock in enumerate(clocks):
        t.now = starts[rank]
        clock.close_step(steps)
    return [c.summary() for c in clocks]


def _base(rank: int, step: int, name: str) -> float:
    return {DATA: 0.004, FORWARD: 0.010, BACKWARD: 0.020, OPT: 0.003}[name]


def _judge(summaries: list[dict[str, Any] | None], world: int) -> tuple[StragglerLog, list[str]]:
    log = StragglerLog(world)
    by_rank = {r: s for r, s in enumerate(summaries) if s is not None}
    hosts = {r: f"h{r}" for r in by_rank}
    first = log.update(assess(by_rank), hosts)
    assert first == [], first  # one judgement is not enough (policy.confirm): the next tick's confirms it
    return log, log.update(assess(by_rank), hosts)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_balanced_ranks_with_jitter_name_nobody(clock_time: FakeTime, world: int) -> None:
    for seed in range(5):
        summaries = _ranks_run(clock_time, world, 60, _base, seed=seed)
        log, lines = _judge(summaries, world)
        assert lines == [] and log.reports == [], (seed, lines)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_rank_slower_in_data_loading_is_named_with_that_phase(clock_time: FakeTime, world: int) -> None:
    def busy(rank: int, step: int, name: str) -> float:
        return _base(rank, step, name) + (0.030 if rank == 1 and name == DATA else 0.0)

    summaries = _ranks_run(clock_time, world, 60, busy)
    log, lines = _judge(summaries, world)
    assert len(log.reports) == 1, lines
    report = log.reports[0]
    assert (report.rank, report.host, report.phase) == (1, "h1", DATA)
    assert report.factor >= 1.7 and 26.0 <= report.excess_ms <= 34.0, report
    assert (report.first_step, report.last_step) == (60 - WINDOW + 1, 60)
    ref = "the faster rank's" if world == 2 else "the median rank's"
    assert len(lines) == 1, lines
    assert re.fullmatch(
        rf"rank 1 \(host h1\) is a straggler: \d\.\dx {ref} busy time \(rank \d\) over steps "
        rf"{60 - WINDOW + 1}-60, \+(\d+\.\d) ms/step in {DATA}",
        lines[0],
    ), lines
    assert 26.0 <= float(lines[0].split("+")[1].split()[0]) <= 34.0, lines


def test_the_slow_phase_is_the_one_named(clock_time: FakeTime) -> None:
    def busy(rank: int, step: int, name: str) -> float:
        return _base(rank, step, name) * (3.0 if rank == 2 and name == FORWARD else 1.0)

    log, _ = _judge(_ranks_run(clock_time, 4, 40, busy), 4)
    assert [(r.rank, r.phase) for r in log.reports] == [(2, FORWARD)]


def test_short_spikes_name_nobody(clock_time: FakeTime) -> None:
    """Every rank in turn has a few very slow steps (less than half a window each): medians do not move."""

    def busy(rank: int, step: int, name: str) -> float:
        spike = name == DATA and step % 10 == rank and step % 20 < 10  # one step in ten, per rank
        return _base(rank, step, name) + (0.2 if spike else 0.0)

    for world in (2, 4):
        log, lines = _judge(_ranks_run(clock_time, world, 80, busy), world)
        assert log.reports == [], lines


def test_small_relative_difference_or_small_absolute_difference_names_nobody(clock_time: FakeTime) -> None:
    # +10% on a 37 ms step: relative threshold not reached
    def ten_percent(rank: int, step: int, name: str) -> float:
        return _base(rank, step, name) * (1.1 if rank == 1 else 1.0)

    assert _judge(_ranks_run(clock_time, 2, 40, ten_percent), 2)[0].reports == []

    # 2x on a tiny step (+2 ms): absolute threshold not reached
    def tiny(rank: int, step: int, name: str) -> float:
        return _base(rank, step, name) / 20 * (2.0 if rank == 1 else 1.0)

    assert _judge(_ranks_run(clock_time, 2, 40, tiny), 2)[0].reports == []


def test_one_line_per_change_and_a_line_on_recovery() -> None:
    log = StragglerLog(2)

    def summary(busy: float, phase: str, last: int) -> dict[str, Any]:
        return {"first": last - 15, "last": last, "busy_ms": busy, "step_ms": 60.0, "phases": {phase: busy}}

    hosts = {0: "a", 1: "b"}
    slow = {0: summary(20.0, DATA, 30), 1: summary(50.0, DATA, 30)}
    assert log.update(assess(slow), hosts) == []  # a first slow window: not yet (confirm = 2)
    assert log.update(assess({0: summary(20.0, DATA, 31), 1: summary(20.0, DATA, 31)}), hosts) == []
    assert log.update(assess(slow), hosts) == []  # the streak was broken: counting again
    lines = log.update(assess({0: summary(20.0, DATA, 32), 1: summary(50.0, DATA, 32)}), hosts)
    assert len(lines) == 1 and "over steps 15-32" in lines[0], lines  # the streak's first window's start
    slow = {0: summary(20.0, DATA, 40), 1: summary(55.0, DATA, 40)}
    assert log.update(assess(slow), hosts) == []  # still one, same phase: silent, the report grows
    assert (log.reports[0].last_step, log.reports[0].factor) == (40, 2.75)
    # between the two thresholds: still a straggler (no flapping)
    assert log.update(assess({0: summary(20.0, DATA, 50), 1: summary(23.0, DATA, 50)}), hosts) == []
    lines = log.update(assess({0: summary(20.0, DATA, 60), 1: summary(20.5, DATA, 60)}), hosts)
    assert len(lines) == 1 and "rank 1 (host b) is no longer a straggler" in lines[0], lines
    assert [r.ongoing for r in log.reports] == [False]
    assert [(r.first_step, r.last_step) for r in log.reports] == [(15, 50)]
    snap = log.snapshot()
    assert snap[0].as_dict()["rank"] == 1 and snap[0] is not log.reports[0]


def test_the_clock_skips_the_first_steps_and_needs_a_full_window(clock_time: FakeTime) -> None:
    clock = PhaseClock("startup")
    for step in range(WINDOW + phase_clock.SKIP_STEPS):
        clock.switch(FORWARD)
        clock_time.now += 0.01
        clock.close_step(step)
    assert clock.summary() is None
    clock_time.now += 0.01
    clock.close_step(WINDOW + phase_clock.SKIP_STEPS)
    summary = clock.summary()
    assert summary is not None and summary["first"] == phase_clock.SKIP_STEPS + 1
    assert summary["step_ms"] == pytest.approx(10.0) and summary["phases"] == {FORWARD: pytest.approx(10.0)}


def test_many_phase_names_share_the_last_slot(clock_time: FakeTime) -> None:
    clock = PhaseClock("startup")
    for i in range(40):
        clock.switch(f"phase {i}")
    assert len(clock.names) == phase_clock.MAX_PHASES and clock.names[-1] == phase_clock.OTHER


def test_a_step_under_way_when_the_clock_is_switched_on_is_not_recorded(clock_time: FakeTime) -> None:
    clock = PhaseClock("startup")
    clock.set_enabled(False)
    clock_time.now += 5.0  # steps nobody timed
    clock.set_enabled(True)
    clock_time.now += 0.01
    clock.close_step(7)
    assert clock.closed == 0
    clock_time.now += 0.02
    clock.close_step(8)
    assert clock.closed == 1 and list(clock.ring[0][:2]) == [8.0, pytest.approx(0.02)]


def test_the_watch_publishes_reads_and_drops_a_silent_peer(
    clock_time: FakeTime, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two ranks' watches over one real c10d store (a HashStore): rank 1 publishes, rank 0 reads and judges,
    prints one line and returns the report; a peer whose summary stops changing is left out."""
    import torch.distributed as dist

    from lockstep.runtime import straggler_reports as module

    store = dist.HashStore()
    clocks = [PhaseClock("startup"), PhaseClock("startup")]
    watches = [module.StragglerWatch(r, 2, clocks[r], f"h{r}", stale_after=2.0) for r in (0, 1)]
    mono = [0.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: mono[0])
    step, own_time = 0, [clock_time.now] * 2  # each rank's own timeline (no waits modelled)
    for tick in range(4):
        for _ in range(WINDOW + 3):
            step += 1
            for rank, clock in enumerate(clocks):
                clock_time.now = own_time[rank]
                clock.switch(DATA)
                clock_time.now += 0.040 if rank == 1 else 0.005
                clock.switch(FORWARD)
                clock_time.now += 0.010
                clock.close_step(step)
                own_time[rank] = clock_time.now
        watches[1].tick(store)
        watches[0].tick(store)
        mono[0] += 0.3
        if tick == 0:
            assert module.stragglers() == []  # one judgement: not yet
    reports = module.stragglers()
    assert [(r.rank, r.host, r.phase) for r in reports] == [(1, "h1", DATA)], reports
    err = capsys.readouterr().err
    assert err.count("[rank 0/2] WARNING lockstep.stragglers: rank 1 (host h1) is a straggler") == 1, err
    # Rank 1 goes silent (its summary stops changing) and rank 0 becomes as slow: judged against the stale
    # summary, rank 1 would be "no longer a straggler"; past stale_after it is left out, nothing is judged.
    mono[0] += 5.0
    clock_time.now = own_time[0]
    for _ in range(WINDOW + 3):
        step += 1
        clocks[0].switch(DATA)
        clock_time.now += 0.040
        clocks[0].switch(FORWARD)
        clock_time.now += 0.010
        clocks[0].close_step(step)
    watches[0].tick(store)
    assert capsys.readouterr().err == ""
    assert module.stragglers()[0].ongoing
