"""Benchmark: lockstep's sharded optimizer state (ZeRO-1) against torch's ZeroRedundancyOptimizer, gloo on CPU.

Each engine trains with AdamW:
- `lockstep`: `lockstep.replicate(module)` and `handle.shard_optimizer(AdamW(...))` (the engine's bucketed
  all-reduce, each rank steps its share, one all-gather of the parameters per dtype);
- `torch`: torch's DistributedDataParallel and `ZeroRedundancyOptimizer(params, optimizer_class=AdamW)`
  (torch's all-reduce, each rank steps its share, a broadcast per rank);
- `plain` and `torch_plain`: each engine with the unsharded AdamW (for the memory columns only: what
  sharding saves on each engine).

Protocol (DESIGN.md): one launch per world size; every engine built from the same weights and fed the
same data; a parity check of the parameters after a step before timing; rounds in A-B-B-A order, each a
few warm-up steps then timed steps; a step's time is the slowest rank's; the median of per-round ratios
lockstep/torch with its min-max, and the same protocol with torch on both sides as the noise floor.
Memory: the optimizer state's bytes on each rank (exact: the tensors it holds), and the peak RSS per rank
of separate launches (median of several, interleaved).

    OMP_NUM_THREADS=1 python benchmarks/shard_optimizer.py --model mlp --world-sizes 2 --rounds 6
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
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import lockstep  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

LR = 1e-4

# ---------------------------------------------------------------- per rank


class _Engine:
    def __init__(self, kind: str, name: str, state: dict[str, torch.Tensor]) -> None:
        self.kind, self.name = kind, name
        self.module = build(name)
        self.module.load_state_dict(state)
        if kind == "torch":
            self.model: Any = TorchDDP(self.module)
            self.opt: Any = ZeroRedundancyOptimizer(
                self.module.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
            )
            self.inner = self.opt.optim
        elif kind == "torch_plain":
            self.model = TorchDDP(self.module)
            self.opt = self.inner = torch.optim.AdamW(self.module.parameters(), lr=LR)
        else:
            self.model = self.module
            self.handle = lockstep.replicate(self.module)
            self.inner = torch.optim.AdamW(self.module.parameters(), lr=LR)
            self.opt = self.handle.shard_optimizer(self.inner) if kind == "lockstep" else self.inner

    def step(self, step: int) -> None:
        x, y = batch(self.name, dist.get_rank(), step)
        self.opt.zero_grad(set_to_none=True)
        loss(self.name, self.model(x), y).backward()
        self.opt.step()

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds."""
        return sum(
            t.numel() * t.element_size()
            for s in (
                self.opt if self.kind == "lockstep" else self.inner
            ).state.values()  # lockstep: the share
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )


def _parity(a: _Engine, b: _Engine) -> float:
    """Max relative difference of the parameters after one step from the same weights and data."""
    for engine in (a, b):
        engine.step(0)
    worst = 0.0
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        pa, pb = pa.detach(), pb.detach()
        scale = float(pb.abs().max()) or 1.0
        worst = max(worst, float((pa - pb).abs().max()) / scale)
    if worst > 1e-5:
        raise RuntimeError(f"parameter parity check failed: max relative difference {worst:.3g}")
    return worst


def bench_worker(name: str, rounds: int, warmup: int, steps: int, pairs: list[str]) -> dict[str, Any]:
    state = build(name).state_dict()
    result: dict[str, Any] = {}
    for pair in pairs:
        kind_a = "lockstep" if pair == "lockstep/torch" else "torch"
        a, b = _Engine(kind_a, name, state), _Engine("torch", name, state)
        result[f"parity {pair}"] = _parity(a, b)
        result[pair] = paired_rounds(a, b, rounds, warmup, steps)
        if pair == "lockstep/torch":
            result["state_bytes"] = {"lockstep": a.state_bytes(), "torch": b.state_bytes()}
        del a, b
    for kind in ("plain", "torch_plain"):
        plain = _Engine(kind, name, state)
        plain.step(0)
        result["state_bytes"][kind] = plain.state_bytes()
        del plain
    return result


def memory_worker(name: str, kind: str, steps: int) -> float:
    engine = _Engine(kind, name, build(name).state_dict())
    for i in range(steps):
        engine.step(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB


# ---------------------------------------------------------------- driver


def _peak_rss(name: str, world: int, launches: int) -> dict[str, float]:
    """Median over interleaved launches of the larger rank's peak RSS, per engine (MiB)."""
    kinds = ["lockstep", "torch", "plain", "torch_plain"]
    peaks: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(launches):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            peaks[kind].append(max(run_distributed(memory_worker, world, args=(name, kind, 3), timeout=900)))
    return {kind: statistics.median(values) for kind, values in peaks.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=list(MODELS))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine per round")
    parser.add_argument("--memory-launches", type=int, default=2, help="launches per engine for peak RSS")
    parser.add_argument(
        "--out", default=None, help="report path (default benchmarks/results/<date>-shard_optimizer.md)"
    )
    args = parser.parse_args(argv)
    pairs = ["lockstep/torch", "torch/torch"]
    rows, memory_rows = [], []
    for world in args.world_sizes:
        res = run_distributed(
            bench_worker, world, args=(args.model, args.rounds, args.warmup, args.steps, pairs), timeout=3600
        )
        main_pair, floor = res[0]["lockstep/torch"], res[0]["torch/torch"]
        row = (
            f"| {args.model} | {world} | {main_pair['a_ms']:.1f} | {main_pair['b_ms']:.1f} "
            f"| {fmt_ratios(main_pair['ratios'])} | {fmt_ratios(floor['ratios'])} "
            f"| {res[0]['parity lockstep/torch']:.1e} |"
        )
        print(row, flush=True)
        rows.append(row)
        mib = 1024 * 1024
        per_rank = [r["state_bytes"] for r in res]
        rss = _peak_rss(args.model, world, args.memory_launches) if args.memory_launches else {}
        for kind in ("plain", "lockstep", "torch_plain", "torch"):
            shares = "/".join(f"{b[kind] / mib:.1f}" for b in per_rank)
            full = per_rank[0]["plain"]
            largest = max(b[kind] for b in per_rank)
            memory_rows.append(
                f"| {args.model} | {world} | {kind} | {shares} | {largest / full:.3f} | {rss[kind]:.0f} |"
                if rss
                else f"| {args.model} | {world} | {kind} | {shares} | {largest / full:.3f} | - |"
            )
            print(memory_rows[-1], flush=True)
    header = (
        "| model | world | lockstep ms/step | torch ZeRO ms/step | step ratio lockstep/torch, median [min-max] "
        "| noise floor torch/torch | parameter parity (max rel) |\n|---|---|---|---|---|---|---|"
    )
    memory_header = (
        "| model | world | optimizer | state MiB per rank (rank 0/1/...) | largest share / unsharded "
        "| peak RSS MiB (larger rank, median) |\n|---|---|---|---|---|---|"
    )
    machine = f"{machine_line()}; AdamW; {args.rounds} rounds A-B-B-A x {args.steps} timed steps (+{args.warmup} warm-up)"
    report = (
        f"# Sharded optimizer state: lockstep vs torch's ZeroRedundancyOptimizer ({datetime.date.today()})\n\n"
        f"Machine: {machine}\n\n## Step time\n\n{header}\n"
        + "\n".join(rows)
        + f"\n\n## Memory\n\n{memory_header}\n"
        + "\n".join(memory_rows)
        + "\n"
    )
    write_report(report, "shard_optimizer", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
