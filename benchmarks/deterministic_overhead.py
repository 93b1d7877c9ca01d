"""Benchmark: what deterministic mode costs a step (issue 13: at most 15% time and 25% peak memory at world 2).

Per model, one launch of 2 gloo ranks holding two replicas built from the same weights: "default"
(lockstep.replicate with SyncPolicy(): the bucketed, overlapped reducer) and "deterministic"
(SyncPolicy(deterministic=True) through handle.accumulate). Both train the same global batch of K
micro-batches (the model's benchmark batch, halved: K = 4, two per rank): default with no_sync on the
rank's first micro-batch, deterministic with its exact reduction. Rounds in A-B-B-A order; a step's time
is the slowest rank's; median of per-round ratios deterministic/default with min-max, and default/default
as the noise floor. Peak memory: the peak RSS of a separate launch per mode (median of launches, the
larger rank), 4 steps each.

    OMP_NUM_THREADS=1 python benchmarks/deterministic_overhead.py --models mlp resnet many_small --rounds 6
"""

from __future__ import annotations

import argparse
import datetime
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchmarks.common import MODELS, abba, batch, build, fmt_ratios, loss, machine_line, slowest_rank_seconds  # noqa: E402

import lockstep  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

K = 4


def _micro_batch(name: str, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(name, k // 2, step)
    half = x.shape[0] // 2
    part = slice(0, half) if k % 2 == 0 else slice(half, 2 * half)
    return x[part], y[part]


def bench_worker(name: str, rounds: int, warmup: int, steps: int) -> dict[str, Any]:
    steppers = {}
    for mode in ("default", "deterministic"):
        steppers[mode] = _stepper(name, mode)
    steppers["default2"] = steppers["default"]
    result: dict[str, list[float]] = {
        "det/default": [],
        "default/default": [],
        "default_ms": [],
        "det_ms": [],
    }
    for r in range(rounds):
        spent: dict[str, list[float]] = {"default": [], "deterministic": [], "default2": []}
        for mode in abba(("deterministic", "default", "default2"), r):
            spent[mode].append(slowest_rank_seconds(steppers[mode], warmup, steps // 2 or 1, start=100 * r))
        det, default, default2 = (sum(spent[m]) for m in ("deterministic", "default", "default2"))
        result["det/default"].append(det / default)
        result["default/default"].append(default2 / default)
        result["default_ms"].append(1000 * default / len(spent["default"]))
        result["det_ms"].append(1000 * det / len(spent["deterministic"]))
    return result


def _stepper(name: str, mode: str) -> Any:
    """A step function for one replica of `name` in `mode`: the global batch's K micro-batches, then SGD."""
    module = build(name)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)
    if mode == "deterministic":
        det = lockstep.replicate(module, policy=lockstep.SyncPolicy(deterministic=True))

        def micro(b: tuple[torch.Tensor, torch.Tensor]) -> None:
            loss(name, module(b[0]), b[1]).backward()

        def deterministic_step(i: int) -> None:
            mine = {k: _micro_batch(name, i, k) for k in det.owned_micro_batches(K)}
            det.accumulate(micro, mine, num_micro_batches=K, step=i)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return deterministic_step
    handle = lockstep.replicate(module)
    world = dist.get_world_size()
    mine = list(range(dist.get_rank(), K, world))

    def step(i: int) -> None:
        for index, k in enumerate(mine):
            x, y = _micro_batch(name, i, k)
            if index == len(mine) - 1:
                (loss(name, module(x), y) * world / K).backward()
            else:
                with handle.no_sync():
                    (loss(name, module(x), y) * world / K).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def memory_worker(name: str, mode: str, steps: int) -> float:
    step = _stepper(name, mode)
    for i in range(steps):
        step(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "resnet", "many_small"], choices=sorted(MODELS)
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--memory-launches", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    lines = [
        f"# Deterministic mode overhead, {datetime.date.today()}",
        "",
        machine_line(),
        f"world size 2, K = {K} micro-batches per step (2 per rank), SGD, {args.rounds} rounds A-B-B-A, "
        f"{args.steps} timed steps per round",
        "",
        "| model | default ms/step | deterministic ms/step | time det/default | noise default/default "
        "| peak RSS default MiB | peak RSS det MiB | memory det/default |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        r = run_distributed(bench_worker, 2, args=(name, args.rounds, args.warmup, args.steps), timeout=1800)[
            0
        ]
        peaks: dict[str, list[float]] = {"default": [], "deterministic": []}
        for launch in range(args.memory_launches):
            for mode in ("default", "deterministic") if launch % 2 == 0 else ("deterministic", "default"):
                peaks[mode].append(max(run_distributed(memory_worker, 2, args=(name, mode, 4), timeout=600)))
        mem = {m: statistics.median(v) for m, v in peaks.items()}
        line = (
            f"| {name} | {statistics.median(r['default_ms']):.1f} | {statistics.median(r['det_ms']):.1f} | "
            f"{fmt_ratios(r['det/default'])} | {fmt_ratios(r['default/default'])} | {mem['default']:.0f} | "
            f"{mem['deterministic']:.0f} | {mem['deterministic'] / mem['default']:.3f} |"
        )
        print(line, flush=True)
        lines.append(line)
    out = Path(args.out) / f"{datetime.date.today()}-deterministic_overhead.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
