"""Benchmark: what the straggler reports cost a training step (issue 36: at most 1% at world size 2).

Per model, one launch of 2 gloo ranks and one lockstep.DistributedDataParallel, with progress tracking and
the hang watchdog running throughout (their cost is benchmarks/hang_watchdog_overhead.py's); rounds in
A-B-B-A order between "on" (the per-phase accounting of runtime/phase_clock.py on the main thread, and each
heartbeat tick publishing the rank's window summary, rank 0 reading every rank's and judging) and "off"
(the accounting disabled: the tick publishes nothing). Each step loads its batch inside
`lockstep.phase("data loading")`, as a loop of the user's own would. A step's time is the slowest rank's;
the median of per-round ratios on/off with its min-max, and off/off as the noise floor. The hang timeout
defaults to 2 s: the shortest tick (0.2 s), the most publications and judgements per step.

    OMP_NUM_THREADS=1 python benchmarks/straggler_overhead.py --models mlp many_small --rounds 8
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchmarks.common import (  # noqa: E402
    MODELS,
    abba,
    batch,
    build,
    fmt_ratios,
    loss,
    machine_line,
    per_call_us,  # noqa: E402
    slowest_rank_seconds,
    write_report,
)

import lockstep  # noqa: E402
from lockstep.runtime import watchdog  # noqa: E402
from lockstep.runtime.progress import PROGRESS  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402


def bench_worker(name: str, rounds: int, warmup: int, steps: int, timeout: float) -> dict[str, Any]:
    watchdog.start(timeout)
    module = build(name)
    model = lockstep.DistributedDataParallel(module)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step(i: int) -> None:
        with lockstep.phase("data loading"):
            x, y = batch(name, dist.get_rank(), i)
        opt.zero_grad(set_to_none=True)
        loss(name, model(x), y).backward()
        opt.step()

    result: dict[str, list[float]] = {"on/off": [], "off/off": [], "on_ms": [], "off_ms": []}
    for r in range(rounds):
        spent: dict[str, list[float]] = {"on": [], "off": [], "off2": []}
        for mode in abba(("on", "off", "off2"), r):
            PROGRESS.clock.set_enabled(mode == "on")
            spent[mode].append(slowest_rank_seconds(step, warmup, steps // 2 or 1, start=100 * r))
        on, off, off2 = (sum(spent[m]) for m in ("on", "off", "off2"))
        result["on/off"].append(on / off)
        result["off/off"].append(off2 / off)
        result["on_ms"].append(on / 2 * 1e3)
        result["off_ms"].append(off / 2 * 1e3)
    PROGRESS.clock.set_enabled(True)
    dog = watchdog.current()
    if dog is not None:
        result["tick_us"] = [_tick_cost_us(dog)]
    dist.barrier()
    # The watchdog stops first: the loop below closes thousands of empty steps, which its ticks would
    # publish and judge (naming a "straggler" 1000x slower than a rank whose steps take microseconds).
    watchdog.stop()
    result["accounting_us"] = [_accounting_cost_us(model)]
    return result


def _accounting_cost_us(model: Any) -> float:
    """What the accounting adds to one step of this model, without the noise of a step: the step's phase
    changes and one tracked wait per bucket, with the clock on minus with it off, each in a loop."""
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
        PROGRESS.set_phase("optimizer")

    costs = {}
    for enabled in (True, False, True, False):
        PROGRESS.clock.set_enabled(enabled)
        costs.setdefault(enabled, []).append(per_call_us(one_step, 5000))
    PROGRESS.clock.set_enabled(True)
    return min(costs[True]) - min(costs[False])


def _tick_cost_us(dog: Any) -> float:
    """One tick's straggler work on this rank: the window summary and its store write (on rank 0 also
    reading every rank's summary and judging)."""
    watch = dog.stragglers

    def tick() -> None:
        watch._published = -1  # as if a step had closed since the last tick
        watch.tick(dog.store)

    return per_call_us(tick, 200)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "many_small"], choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hang-timeout", type=float, default=2.0, help="the watchdog's (tick: a tenth)")
    parser.add_argument(
        "--out", default=None, help="report path (default benchmarks/results/<date>-straggler_overhead.md)"
    )
    args = parser.parse_args(argv)
    lines = [
        f"# Straggler report overhead, {datetime.date.today()}",
        "",
        machine_line(),
        f"world size 2, {args.rounds} rounds A-B-B-A (on, off, off again), {args.steps} timed steps per round, "
        f"hang timeout {args.hang_timeout:g} s (a tick every {watchdog.tick_for(args.hang_timeout):g} s); "
        "tracking and the watchdog run in every mode",
        "",
        "Ratios are timed steps; 'accounting' is the main thread's time that the per-phase accounting adds to",
        "one step of the model (its phase changes and waits, on minus off, in a loop: no step noise); 'tick' is",
        "the watchdog thread's straggler work per tick (summary, store write; rank 0 also reads and judges).",
        "",
        "| model | step ms on | step ms off | ratio on/off, median [min-max] | noise floor off/off | accounting us/step (% of step) | tick us, rank 0 / rank 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        res = run_distributed(
            bench_worker,
            2,
            args=(name, args.rounds, args.warmup, args.steps, args.hang_timeout),
            timeout=1200,
        )
        r0, r1 = res[0], res[1]
        off_ms = statistics.median(r0["off_ms"])
        acc = r0["accounting_us"][0]
        ticks = " / ".join(f"{r['tick_us'][0]:.0f}" if r.get("tick_us") else "n/a" for r in (r0, r1))
        lines.append(
            f"| {name} | {statistics.median(r0['on_ms']):.1f} | {off_ms:.1f} | "
            f"{fmt_ratios(r0['on/off'])} | {fmt_ratios(r0['off/off'])} | "
            f"{acc:.1f} ({acc / 10 / off_ms:.3f}%) | {ticks} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(text, "straggler_overhead", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
