"""Benchmark: lockstep's engine against torch's DistributedDataParallel, gloo on CPU (issue 3).

Protocol (DESIGN.md): one launch per model and world size; both engines built from identical weights
and fed identical data; a gradient parity check before timing; rounds in A-B-B-A order, each a few
warm-up steps then timed steps; a step's time is the slowest rank's (all-reduce MAX); the median of
per-round ratios lockstep/torch with its min-max; the same protocol with torch on both sides gives the
noise floor. Peak RSS per rank comes from separate launches, interleaved, median of several per engine.

    OMP_NUM_THREADS=1 python benchmarks/engine_vs_ddp.py --models mlp --rounds 6 --world-sizes 1 2
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
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import lockstep  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

# ---------------------------------------------------------------- per rank


class _Engine:
    def __init__(self, kind: str, name: str, state: dict[str, torch.Tensor]) -> None:
        self.module = build(name)
        self.module.load_state_dict(state)
        cls = lockstep.DistributedDataParallel if kind == "lockstep" else TorchDDP
        self.model = cls(self.module)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4)
        self.name = name

    def step(self, step: int) -> None:
        x, y = batch(self.name, dist.get_rank(), step)
        self.opt.zero_grad(set_to_none=True)
        loss(self.name, self.model(x), y).backward()
        self.opt.step()


def _parity(a: _Engine, b: _Engine) -> float:
    worst = 0.0
    for engine in (a, b):
        engine.opt.zero_grad(set_to_none=True)
        x, y = batch(engine.name, dist.get_rank(), 0)
        loss(engine.name, engine.model(x), y).backward()
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        scale = float(pb.grad.abs().max()) or 1.0
        worst = max(worst, float((pa.grad - pb.grad).abs().max()) / scale)
    if worst > 1e-4:
        raise RuntimeError(f"gradient parity check failed: max relative difference {worst:.3g}")
    return worst


def bench_worker(name: str, rounds: int, warmup: int, steps: int, pairs: list[str]) -> dict[str, Any]:
    state = build(name).state_dict()
    result: dict[str, Any] = {}
    for pair in pairs:
        kind_a = "lockstep" if pair == "lockstep/torch" else "torch"
        a, b = _Engine(kind_a, name, state), _Engine("torch", name, state)
        result[f"parity {pair}"] = _parity(a, b)
        result[pair] = paired_rounds(a, b, rounds, warmup, steps)
        if kind_a == "lockstep":
            stats = a.model.stats()
            result["lockstep_stats"] = (
                None
                if stats.mean is None
                else {
                    "comm_ms": stats.mean.comm_ms,
                    "hidden_ms": stats.mean.comm_hidden_ms,
                    "finalize_ms": stats.mean.finalize_ms,
                    "num_buckets": stats.num_buckets,
                    "backward_ms": stats.mean.backward_ms,
                    "forward_ms": stats.mean.forward_ms,
                }
            )
        del a, b
    return result


def memory_worker(name: str, kind: str, steps: int) -> float:
    engine = _Engine(kind, name, build(name).state_dict())
    for i in range(steps):
        engine.step(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB


# ---------------------------------------------------------------- driver


def _memory_ratio(name: str, world: int, launches: int) -> str:
    """Median peak RSS over interleaved launches: one launch's peak moves by +-5% with the allocator's luck."""
    peaks: dict[str, list[float]] = {"lockstep": [], "torch": []}
    for i in range(launches):
        for kind in ("lockstep", "torch") if i % 2 == 0 else ("torch", "lockstep"):
            peaks[kind].append(max(run_distributed(memory_worker, world, args=(name, kind, 4), timeout=600)))
    ours, theirs = statistics.median(peaks["lockstep"]), statistics.median(peaks["torch"])
    return f"{ours / theirs:.3f} ({ours:.0f}/{theirs:.0f} MiB, median of {launches})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine per round")
    parser.add_argument("--no-noise-floor", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-launches", type=int, default=3, help="launches per engine for peak RSS")
    parser.add_argument(
        "--out", default=None, help="report path (default benchmarks/results/<date>-engine_vs_ddp.md)"
    )
    args = parser.parse_args(argv)
    pairs = ["lockstep/torch"] + ([] if args.no_noise_floor else ["torch/torch"])
    rows = []
    for name in args.models:
        for world in args.world_sizes:
            res = run_distributed(
                bench_worker, world, args=(name, args.rounds, args.warmup, args.steps, pairs), timeout=1800
            )[0]
            mem = ""
            if not args.no_memory:
                mem = _memory_ratio(name, world, args.memory_launches)
            main_pair = res["lockstep/torch"]
            floor = fmt_ratios(res["torch/torch"]["ratios"]) if "torch/torch" in res else "-"
            st = res.get("lockstep_stats") or {}
            row = (
                f"| {name} | {world} | {main_pair['a_ms']:.1f} | {main_pair['b_ms']:.1f} | {fmt_ratios(main_pair['ratios'])} "
                f"| {floor} | {mem or '-'} | {res['parity lockstep/torch']:.1e} "
                f"| {st.get('num_buckets', '-')} | {st.get('comm_ms', 0):.1f}/{st.get('hidden_ms', 0):.1f} |"
            )
            print(row, flush=True)
            rows.append(row)
    header = (
        "| model | world | lockstep ms/step | torch ms/step | step ratio lockstep/torch, median [min-max] "
        "| noise floor torch/torch | peak RSS ratio (lockstep/torch) | grad parity (max rel) "
        "| buckets | lockstep comm/hidden ms |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    machine = (
        f"{machine_line()}; {args.rounds} rounds A-B-B-A x {args.steps} timed steps (+{args.warmup} warm-up)"
    )
    report = (
        f"# lockstep engine vs torch DDP ({datetime.date.today()})\n\nMachine: {machine}\n\n{header}\n"
        + "\n".join(rows)
        + "\n"
    )
    write_report(report, "engine_vs_ddp", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
