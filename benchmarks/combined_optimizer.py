"""Benchmark: fit-style steps with the optimizer overlapped and sharded against torch's DDP + AdamW, gloo on
CPU (issue 27, "Targets", second bullet: step time <= 0.90 on mlp and gpt, peak memory <= 0.80 on mlp).

The arms, each a step as lockstep.fit takes it (zero_grad, forward through the DDP face, backward, the
optimizer's step, the LR schedule's step), with AdamW (torch's defaults) on identical weights and data:
- `both`: lockstep.DistributedDataParallel with the gradients as views of the buckets, the optimizer
  sharded (ShardedOptimizer) and overlapped (the engine steps this rank's share of each bucket during
  backward, the owners' broadcasts start then): what `FitConfig(overlap_optimizer=True,
  shard_optimizer=True)` runs (trainer/loop.py, trainer/run/optim.py, trainer/run/steps.py);
- `torch`: torch's DistributedDataParallel and the plain AdamW; `torch2`, the same again (the noise floor);
- with `--arms all`, also fit's other settings, each timed against torch: `plain` (lockstep, plain
  AdamW), `overlap` (overlap_optimizer only) and `shard` (shard_optimizer only, gradients as views).

Protocol (DESIGN.md): one launch per model; a parity check of the parameters after a step; rounds in
A-B-B-A order (common.paired_rounds), a step's time the slowest rank's, per-round ratios as median
[min-max]; torch against torch as the noise floor. Peak RSS: the larger rank's of separate launches per
arm (median, interleaved). The load average of the machine is written into the report.

    OMP_NUM_THREADS=1 python benchmarks/combined_optimizer.py              # default: mlp and gpt, < 3 min
    OMP_NUM_THREADS=1 python benchmarks/combined_optimizer.py --arms all --rounds 6 --steps 10
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchmarks.common import (  # noqa: E402
    MODELS,
    batch,
    build,
    fmt_ratios,
    loss,
    machine_line,
    paired_rounds,
    write_report,
)
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import lockstep  # noqa: E402
from lockstep.engine import ShardedOptimizer  # noqa: E402
from lockstep.engine.replicate import overlap_optimizer  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

LR = 1e-4
ARMS = ("both", "plain", "overlap", "shard")  # lockstep's arms; torch is the reference of each

# ---------------------------------------------------------------- per rank


class _Engine:
    """One arm: the model, its DDP face, the optimizer the loop steps, the schedule."""

    def __init__(self, kind: str, name: str, state: dict[str, torch.Tensor]) -> None:
        self.kind, self.name = kind, name
        self.module = build(name)
        self.module.load_state_dict(state)
        self.inner = torch.optim.AdamW(self.module.parameters(), lr=LR)
        if kind.startswith("torch"):
            self.model: Any = TorchDDP(self.module)
            self.opt: Any = self.inner
        else:
            sharded = kind in ("shard", "both")  # fit then makes the gradients views of the buckets
            self.model = lockstep.DistributedDataParallel(self.module, gradient_as_bucket_view=sharded)
            self.opt = ShardedOptimizer(self.inner) if sharded else self.inner
            if kind in ("overlap", "both"):  # as trainer/run/steps.py's Stepper.overlap does it
                self.opt = overlap_optimizer(self.model, self.opt, clip_grad_norm=False, scaler=None)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.inner, lambda step: 1.0)

    def step(self, step: int) -> None:
        x, y = batch(self.name, dist.get_rank(), step)
        self.opt.zero_grad(set_to_none=True)
        loss(self.name, self.model(x), y).backward()
        self.opt.step()
        self.schedule.step()


def _parity(a: _Engine, b: _Engine) -> float:
    """Max relative difference of the parameters after one step from the same weights and data."""
    for engine in (a, b):
        engine.step(0)
    worst = 0.0
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        scale = float(pb.detach().abs().max()) or 1.0
        worst = max(worst, float((pa.detach() - pb.detach()).abs().max()) / scale)
    if worst > 1e-5:
        raise RuntimeError(f"parameter parity check failed: max relative difference {worst:.3g}")
    return worst


def bench_worker(name: str, arms: list[str], rounds: int, warmup: int, steps: int) -> dict[str, Any]:
    state = build(name).state_dict()
    result: dict[str, Any] = {}
    for arm in [*arms, "torch2"]:
        a, b = _Engine(arm, name, state), _Engine("torch", name, state)
        result[f"parity {arm}"] = _parity(a, b)
        result[arm] = paired_rounds(a, b, rounds, warmup, steps)
        del a, b
    return result


def phases_worker(name: str, arms: list[str], steps: int) -> dict[str, dict[str, float]]:
    """Where the time goes: each arm's median ms of forward, backward (the engine's reduction and, when
    overlapped, the optimizer steps and broadcasts it starts) and optimizer step() (for `both`: the rest
    of the share and the wait for the broadcasts), arms interleaved step by step, on this rank."""
    state = build(name).state_dict()
    engines = {arm: _Engine(arm, name, state) for arm in arms}
    spent: dict[str, dict[str, list[float]]] = {arm: {"fwd": [], "bwd": [], "step": []} for arm in arms}
    for i in range(steps + 1):  # the first step warms up
        for arm in arms if i % 2 == 0 else arms[::-1]:
            engine = engines[arm]
            x, y = batch(name, dist.get_rank(), i)
            dist.barrier()
            t0 = time.perf_counter()
            engine.opt.zero_grad(set_to_none=True)
            value = loss(name, engine.model(x), y)
            t1 = time.perf_counter()
            value.backward()
            t2 = time.perf_counter()
            engine.opt.step()
            engine.schedule.step()
            t3 = time.perf_counter()
            if i:
                for key, seconds in (("fwd", t1 - t0), ("bwd", t2 - t1), ("step", t3 - t2)):
                    spent[arm][key].append(seconds * 1e3)
    return {arm: {k: statistics.median(v) for k, v in d.items()} for arm, d in spent.items()}


def memory_worker(name: str, kind: str, steps: int) -> float:
    engine = _Engine(kind, name, build(name).state_dict())
    for i in range(steps):
        engine.step(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB


# ---------------------------------------------------------------- driver


def _peak_rss(name: str, kinds: list[str], launches: int) -> dict[str, float]:
    """Median over interleaved launches of the larger rank's peak RSS, per arm (MiB)."""
    peaks: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(launches):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            peaks[kind].append(max(run_distributed(memory_worker, 2, args=(name, kind, 3), timeout=900)))
    return {kind: statistics.median(values) for kind, values in peaks.items()}


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f} (1 min), {five:.2f} (5 min)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=list(MODELS))
    parser.add_argument("--arms", choices=["both", "all"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per arm per round")
    parser.add_argument(
        "--memory-models", nargs="*", default=["mlp"], help="models whose peak RSS is measured"
    )
    parser.add_argument("--memory-launches", type=int, default=1, help="launches per arm for peak RSS")
    parser.add_argument(
        "--phases", type=int, default=0, help="also time forward/backward/step() of every arm over N steps"
    )
    parser.add_argument(
        "--out", default=None, help="report path (default benchmarks/results/<date>-combined_optimizer.md)"
    )
    args = parser.parse_args(argv)
    arms = list(ARMS) if args.arms == "all" else ["both"]
    started, load_before = time.monotonic(), _load()
    rows, memory_rows = [], []
    for name in args.models:
        res = run_distributed(
            bench_worker, 2, args=(name, arms, args.rounds, args.warmup, args.steps), timeout=3600
        )[0]
        floor = fmt_ratios(res["torch2"]["ratios"])
        for arm in arms:
            row = (
                f"| {name} | {arm} | {res[arm]['a_ms']:.1f} | {res[arm]['b_ms']:.1f} "
                f"| {fmt_ratios(res[arm]['ratios'])} | {floor} | {res[f'parity {arm}']:.1e} |"
            )
            print(row, flush=True)
            rows.append(row)
    phase_rows = []
    for name in args.models if args.phases else []:
        kinds = ["torch", "plain", "overlap", "shard", "both"]
        per_rank = run_distributed(phases_worker, 2, args=(name, kinds, args.phases), timeout=3600)
        for rank, spent in enumerate(per_rank):
            for kind in kinds:
                t = spent[kind]
                phase_rows.append(
                    f"| {name} | {rank} | {kind} | {t['fwd']:.1f} | {t['bwd']:.1f} | {t['step']:.1f} "
                    f"| {t['fwd'] + t['bwd'] + t['step']:.1f} |"
                )
                print(phase_rows[-1], flush=True)
    for name in args.memory_models:
        kinds = [*arms, "torch"]
        rss = _peak_rss(name, kinds, args.memory_launches)
        for kind in kinds:
            memory_rows.append(f"| {name} | {kind} | {rss[kind]:.0f} | {rss[kind] / rss['torch']:.3f} |")
            print(memory_rows[-1], flush=True)
    header = (
        "| model | arm | lockstep ms/step | torch DDP ms/step | step ratio arm/torch, median [min-max] "
        "| noise floor torch/torch | parameter parity (max rel) |\n|---|---|---|---|---|---|---|"
    )
    memory_header = "| model | arm | peak RSS MiB (larger rank) | arm/torch |\n|---|---|---|---|"
    machine = (
        f"{machine_line()}; world 2, AdamW; {args.rounds} rounds A-B-B-A x {args.steps} timed steps "
        f"(+{args.warmup} warm-up); load average before {load_before}, after {_load()}; "
        f"{time.monotonic() - started:.0f} s"
    )
    report = (
        f"# The optimizer overlapped and sharded vs torch's DDP + AdamW ({datetime.date.today()})\n\n"
        f"Machine: {machine}\n\n## Step time\n\n{header}\n"
        + "\n".join(rows)
        + (
            "\n\n## Where the time goes (median ms per step, arms interleaved step by step)\n\n"
            "| model | rank | arm | forward | backward | step() | sum |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(phase_rows)
            if phase_rows
            else ""
        )
        + f"\n\n## Memory ({args.memory_launches} launch(es) per arm, median)\n\n{memory_header}\n"
        + "\n".join(memory_rows)
        + "\n"
    )
    write_report(report, "combined_optimizer", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
