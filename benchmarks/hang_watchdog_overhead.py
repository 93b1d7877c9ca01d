"""Benchmark: what the hang watchdog costs a training step (issue 12: at most 1% at world size 2).

Per model, one launch of 2 gloo ranks and one lockstep.DistributedDataParallel; rounds in A-B-B-A order
between "on" (progress tracking of every collective plus the watchdog thread publishing its heartbeat to
the c10d store, at the given hang timeout) and "off" (tracking disabled, no watchdog). A step's time is
the slowest rank's; the median of per-round ratios on/off with its min-max, and off/off as the noise floor.

    OMP_NUM_THREADS=1 python benchmarks/hang_watchdog_overhead.py --models mlp many_small --rounds 8
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
from lockstep.runtime import waits, watchdog  # noqa: E402
from lockstep.runtime.progress import PROGRESS  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402


def _switch(on: bool, timeout: float) -> None:
    PROGRESS.enabled = on
    if on:
        watchdog.start(timeout)
    else:
        watchdog.stop()


def bench_worker(name: str, rounds: int, warmup: int, steps: int, timeout: float) -> dict[str, Any]:
    module = build(name)
    model = lockstep.DistributedDataParallel(module)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step(i: int) -> None:
        x, y = batch(name, dist.get_rank(), i)
        opt.zero_grad(set_to_none=True)
        loss(name, model(x), y).backward()
        opt.step()

    result: dict[str, list[float]] = {"on/off": [], "off/off": [], "on_ms": [], "off_ms": []}
    for r in range(rounds):
        spent: dict[str, list[float]] = {"on": [], "off": [], "off2": []}
        for mode in abba(("on", "off", "off2"), r):
            _switch(mode == "on", timeout)
            spent[mode].append(slowest_rank_seconds(step, warmup, steps // 2 or 1, start=100 * r))
        on, off, off2 = (sum(spent[m]) for m in ("on", "off", "off2"))
        result["on/off"].append(on / off)
        result["off/off"].append(off2 / off)
        result["on_ms"].append(on / 2 * 1e3)
        result["off_ms"].append(off / 2 * 1e3)
    _switch(True, timeout)
    result["tracking_us"] = [_tracking_cost_us(model)]
    dog = watchdog.current()
    result["heartbeat_us"] = [per_call_us(dog._publish, 200)] if dog is not None else []
    return result


def _tracking_cost_us(model: Any) -> float:
    """What tracking adds to one step of this model, without the noise of a step: its phase changes, one
    record per bucket and the tracked missing-gradient count, each done `calls` times in a loop."""
    buckets = [b.buffer for b in model._replica.reducer.buckets]

    def one_step() -> None:
        PROGRESS.begin_step()
        PROGRESS.set_phase("backward")
        for buf in buckets:
            rec = PROGRESS.issue("allreduce (gradient bucket)", (buf,), None)
            PROGRESS.begin_wait(rec)
            PROGRESS.end_wait()
        with waits.tracked("allreduce (missing-gradient count)", (buckets[0],), None):
            pass
        PROGRESS.end_step()

    return per_call_us(one_step, 2000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=300.0,
        help="the watchdog's timeout (its tick is a tenth, 0.2-2 s)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="report path (default benchmarks/results/<date>-hang_watchdog_overhead.md)",
    )
    args = parser.parse_args(argv)
    lines = [
        f"# Hang watchdog overhead, {datetime.date.today()}",
        "",
        machine_line(),
        f"world size 2, {args.rounds} rounds A-B-B-A (on, off, off again), {args.steps} timed steps per round, "
        f"hang timeout {args.hang_timeout:g} s",
        "",
        "Ratios are timed steps; 'tracking' is the CPU time that tracking adds to one step of the model, measured",
        "in a loop (no step noise); 'heartbeat' is the watchdog thread's work per tick (state, stack, store write).",
        "",
        "| model | step ms on | step ms off | ratio on/off, median [min-max] | noise floor off/off | tracking us/step (% of step) | heartbeat us/tick |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        res = run_distributed(
            bench_worker,
            2,
            args=(name, args.rounds, args.warmup, args.steps, args.hang_timeout),
            timeout=1200,
        )[0]
        lines.append(
            f"| {name} | {statistics.median(res['on_ms']):.1f} | {statistics.median(res['off_ms']):.1f} | "
            f"{fmt_ratios(res['on/off'])} | {fmt_ratios(res['off/off'])} | "
            f"{res['tracking_us'][0]:.1f} ({res['tracking_us'][0] / 10 / statistics.median(res['off_ms']):.3f}%) | "
            f"{statistics.median(res['heartbeat_us']) if res['heartbeat_us'] else float('nan'):.0f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(text, "hang_watchdog_overhead", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
