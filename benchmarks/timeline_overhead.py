"""Benchmark: what recording the run's timeline costs a training step (issue 47: at most 1% of a ~15 ms step).

One launch of 2 gloo ranks and one lockstep.DistributedDataParallel around a small MLP (a step of ~10-20 ms
on a CPU core), progress tracking, the phase clock and the hang watchdog running throughout; rounds in
A-B-B-A order between "on" (runtime/timeline/: TIMELINE open and attached to the phase clock, so every phase
change, wait and step boundary is recorded, and the part written every FLUSH_S at a step boundary) and "off"
(TIMELINE detached: the clock's one attribute check). Each step passes through ~10 phases as a user loop
with the trainer's phases would (data loading, forward, backward, between steps, optimizer, metrics), and
waits on each gradient bucket. A step's time is the slowest rank's; the median of per-round ratios on/off
with its min-max, and off/off as the noise floor.

Two numbers without the step's noise: the main thread's recording cost per step (the step's phase changes,
waits and boundary, in a loop, with the timeline attached minus detached), and what one write of the part
costs (amortised over FLUSH_S).

    OMP_NUM_THREADS=1 python benchmarks/timeline_overhead.py --rounds 10
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchmarks.common import (  # noqa: E402
    abba,
    fmt_ratios,
    machine_line,
    per_call_us,  # noqa: E402
    slowest_rank_seconds,
    write_report,
)
from torch import nn  # noqa: E402

import lockstep  # noqa: E402
from lockstep.runtime import watchdog  # noqa: E402
from lockstep.runtime.progress import PROGRESS  # noqa: E402
from lockstep.runtime.timeline import TIMELINE, merge_trace  # noqa: E402
from lockstep.runtime.timeline.recorder import FLUSH_S  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402


def small_mlp(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10),
    )  # fmt: skip


def bench_worker(
    run_dir: str, hidden: int, batch: int, rounds: int, warmup: int, steps: int
) -> dict[str, Any]:
    watchdog.start(30.0)
    rank = dist.get_rank()
    module = small_mlp(hidden)
    model = lockstep.DistributedDataParallel(module)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    data = [
        (torch.randn(batch, 256, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        for _ in range(8)
    ]
    TIMELINE.open(run_dir, track=f"rank {rank}", key=f"bench-rank{rank}")

    def step(i: int) -> None:
        with lockstep.phase("data loading"):
            x, y = data[i % len(data)]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        with lockstep.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        with lockstep.phase("metrics"):
            loss.item()

    result: dict[str, list[float]] = {"on/off": [], "off/off": [], "on_ms": [], "off_ms": []}
    for r in range(rounds):
        spent: dict[str, list[float]] = {"on": [], "off": [], "off2": []}
        for mode in abba(("on", "off", "off2"), r):
            TIMELINE.set_enabled(mode == "on")
            spent[mode].append(slowest_rank_seconds(step, warmup, steps // 2 or 1, start=100 * r))
        on, off, off2 = (sum(spent[m]) for m in ("on", "off", "off2"))
        result["on/off"].append(on / off)
        result["off/off"].append(off2 / off)
        result["on_ms"].append(on / 2 * 1e3)
        result["off_ms"].append(off / 2 * 1e3)
    TIMELINE.set_enabled(True)
    for k in range(40):  # a long run's part: 40 windows around marks, then the recent steps
        TIMELINE.mark(f"bench event {k}", kind="straggler", rank=1 - rank)
        for i in range(25):
            step(i)
    dist.barrier()
    watchdog.stop()
    result["recording_us"] = [_recording_cost_us(model)]
    result["flush_ms"], result["part_kb"] = _flush_cost()
    TIMELINE.close()
    dist.barrier()
    return result


def _recording_cost_us(model: Any) -> float:
    """What recording adds to one step of this loop, without the noise of a step: its phase changes, one
    tracked wait per gradient bucket and its step boundary, timeline attached minus detached, in a loop."""
    buckets = [b.buffer for b in model._replica.reducer.buckets]

    def one_step() -> None:
        with lockstep.phase("data loading"):
            pass
        PROGRESS.begin_step()
        PROGRESS.set_phase("backward")
        for buf in buckets:
            rec = PROGRESS.issue("allreduce (gradient bucket)", (buf,), None)
            PROGRESS.begin_wait(rec)
            PROGRESS.end_wait()
        PROGRESS.end_step()
        with lockstep.phase("optimizer"):
            pass
        with lockstep.phase("metrics"):
            pass

    costs: dict[bool, list[float]] = {}
    for on in (True, False) * 8:  # interleaved, the least of each: the machine's noise only adds
        TIMELINE.set_enabled(on)
        costs.setdefault(on, []).append(per_call_us(one_step, 5000))
    TIMELINE.set_enabled(True)
    return min(costs[True]) - min(costs[False])


def _flush_cost() -> tuple[list[float], list[float]]:
    """One write of this rank's part as it stands (ms), and its size (kB)."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        path = TIMELINE.flush()
        times.append((time.perf_counter() - t0) * 1e3)
    assert path is not None
    return [min(times)], [path.stat().st_size / 1e3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--out", default=None, help="report path (default benchmarks/results/<date>-timeline_overhead.md)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as run_dir:
        res = run_distributed(
            bench_worker,
            2,
            args=(run_dir, args.hidden, args.batch, args.rounds, args.warmup, args.steps),
            timeout=1200,
        )
        trace = merge_trace(run_dir)
        trace_kb = trace.stat().st_size / 1e3 if trace is not None else 0.0
    r0, r1 = res[0], res[1]
    off_ms = statistics.median(r0["off_ms"])
    rec_us = max(r0["recording_us"][0], r1["recording_us"][0])
    flush_ms = max(r0["flush_ms"][0], r1["flush_ms"][0])
    lines = [
        f"# Timeline recording overhead, {datetime.date.today()}",
        "",
        machine_line(),
        f"world size 2, MLP 256-{args.hidden}x3-10, batch {args.batch}, {args.rounds} rounds A-B-B-A (on, off, "
        f"off again), {args.steps} timed steps per round; tracking, the phase clock and the watchdog run in every mode",
        "",
        "Ratios are timed steps; 'recording' is the main thread's time that the timeline adds to one step",
        "(its ~10 phase changes, a wait per gradient bucket, the step boundary; attached minus detached, in a",
        "loop: no step noise); 'write' is one write of a part holding 40 windows and the recent steps, made",
        f"once every {FLUSH_S:g} s at a step boundary.",
        "",
        "| step ms on | step ms off | ratio on/off, median [min-max] | noise floor off/off | recording us/step (% of step) | write ms (% of FLUSH_S) | part kB | trace.json kB |",
        "|---|---|---|---|---|---|---|---|",
        f"| {statistics.median(r0['on_ms']):.1f} | {off_ms:.1f} | {fmt_ratios(r0['on/off'])} | "
        f"{fmt_ratios(r0['off/off'])} | {rec_us:.1f} ({rec_us / 10 / off_ms:.3f}%) | "
        f"{flush_ms:.1f} ({flush_ms / 10 / FLUSH_S:.3f}%) | {r0['part_kb'][0]:.0f} | {trace_kb:.0f} |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(text, "timeline_overhead", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
