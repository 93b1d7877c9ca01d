"""Benchmark: each engine's own cost per step, with communication free (issue 27).

One process joins as rank 0 of a world of W through a no-op process group (benchmarks/noop_group.py:
every collective completes at once), so both engines do all of their own work (hooks, bucket copies,
launching the all-reduce, scaling, writing back) and nothing else. Four arms on identical weights and
batches, each a full training step (zero_grad, forward, backward, SGD step):

- bare: the model alone, the limit of a data-parallel step;
- torch: torch.nn.parallel.DistributedDataParallel (its C++ reducer);
- lockstep: lockstep.DistributedDataParallel (the drop-in class, torch's bucket layout);
- replicate: lockstep.replicate (lockstep's own layout);
- torch2: a second torch DDP, the noise floor (torch2/torch is what a ratio of equals reads as).

Before timing, one step of each arm from the same weights on the same batch: torch's and the drop-in
class's gradients must be equal bit for bit, and every engine's must be the bare model's divided by W.
Then rounds whose arm order reverses every round (benchmarks.common.round_order), each arm: warm-up steps,
then timed steps. Reported per model and dtype: ms per step, the per-round ratios lockstep/torch,
replicate/torch, lockstep/bare and torch/bare as median [min-max], the noise floor torch2/torch, and
each engine's CPU time per step beyond the bare model's (process CPU time, same round). On CUDA, each timed span ends with a synchronize.

    OMP_NUM_THREADS=1 python benchmarks/engine_overhead.py --models small_mlp many_small mlp resnet gpt
    python benchmarks/engine_overhead.py --device cuda --world-size 8 --dtypes fp32 bf16
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchmarks.noop_group as noop  # noqa: E402
import torch  # noqa: E402
from benchmarks.common import MODELS, batch, build, fmt_ratios, loss, machine_line, round_order  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import lockstep  # noqa: E402

ARMS = ("bare", "torch", "lockstep", "replicate", "torch2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def small_mlp() -> nn.Module:
    """A small, fast step (4 layers of 256, batch 32): where an engine's own cost shows on a CPU."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )  # fmt: skip


def _model(name: str) -> nn.Module:
    return small_mlp() if name == "small_mlp" else build(name)


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "small_mlp":
        g = torch.Generator().manual_seed(step)
        return torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
    return batch(name, 0, step)


def _loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss("mlp" if name == "small_mlp" else name, out.float(), y)


class Arm:
    """One engine (or none) around its own copy of the model, with its own optimizer."""

    def __init__(self, kind: str, name: str, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str):
        self.kind, self.name, self.dtype, self.device = kind, name, dtype, device
        self.module = _model(name).to(device=device, dtype=dtype)
        self.module.load_state_dict(state)
        if kind in ("torch", "torch2"):
            self.model: Any = TorchDDP(self.module)
        elif kind == "lockstep":
            self.model = lockstep.DistributedDataParallel(self.module)
        elif kind == "replicate":
            lockstep.replicate(self.module)
            self.model = self.module
        else:
            self.model = self.module
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4)

    def inputs(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _batch(self.name, step)
        x = x.to(self.device, dtype=self.dtype) if x.is_floating_point() else x.to(self.device)
        return x, y.to(self.device, dtype=self.dtype) if y.is_floating_point() else y.to(self.device)

    def step(self, step: int) -> None:
        x, y = self.inputs(step)
        self.opt.zero_grad(set_to_none=True)
        _loss(self.name, self.model(x), y).backward()
        self.opt.step()

    def grads(self, step: int) -> list[torch.Tensor]:
        """The gradients of one step (no optimizer step), as float64 on the CPU."""
        x, y = self.inputs(step)
        self.opt.zero_grad(set_to_none=True)
        _loss(self.name, self.model(x), y).backward()
        return [p.grad.detach().double().cpu() for p in self.module.parameters() if p.grad is not None]

    def timed(self, warmup: int, steps: int, start: int) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) per step over `steps` timed steps."""
        for i in range(warmup):
            self.step(start + i)
        self._sync()
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            self.step(start + warmup + i)
        self._sync()
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def parity(arms: dict[str, Arm], world: int) -> dict[str, float]:
    """Max relative difference of each engine's gradients from the bare model's / W; torch vs lockstep
    must be 0 (the drop-in class keeps torch's bits)."""
    grads = {kind: arm.grads(10_000) for kind, arm in arms.items()}
    reference = [g / world for g in grads["bare"]]
    out = {}
    for kind in ("torch", "lockstep", "replicate"):
        diffs = [
            ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            for a, b in zip(grads[kind], reference)
        ]
        out[kind] = max(diffs)
    same = all(torch.equal(a, b) for a, b in zip(grads["torch"], grads["lockstep"]))
    out["torch_vs_lockstep_equal"] = float(same)
    if not same:
        raise SystemExit(f"parity: the drop-in class's gradients differ from torch's ({arms['bare'].name})")
    return out


def measure(name: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    state = _model(name).to(dtype=DTYPES[dtype]).state_dict()
    arms = {kind: Arm(kind, name, state, DTYPES[dtype], args.device) for kind in ARMS}
    checks = parity(arms, args.world_size)
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in ARMS}
    for r in range(args.rounds):
        for kind in round_order(ARMS, r):
            times[kind].append(arms[kind].timed(args.warmup, args.steps, start=r * 1000))
    del arms

    def ratios(a: str, b: str) -> list[float]:
        return [x[0] / y[0] for x, y in zip(times[a], times[b])]

    def extra_cpu_ms(kind: str) -> float:
        return statistics.median((x[1] - y[1]) * 1e3 for x, y in zip(times[kind], times["bare"]))

    return {
        "model": name,
        "dtype": dtype,
        "ms": {kind: statistics.median(t[0] for t in times[kind]) * 1e3 for kind in ARMS},
        "lockstep/torch": fmt_ratios(ratios("lockstep", "torch")),
        "replicate/torch": fmt_ratios(ratios("replicate", "torch")),
        "lockstep/bare": fmt_ratios(ratios("lockstep", "bare")),
        "replicate/bare": fmt_ratios(ratios("replicate", "bare")),
        "torch/bare": fmt_ratios(ratios("torch", "bare")),
        "noise": fmt_ratios(ratios("torch2", "torch")),
        "engine_cpu_ms": {kind: extra_cpu_ms(kind) for kind in ("torch", "lockstep", "replicate")},
        "parity": checks,
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"# Engine overhead, no-op process group ({datetime.date.today()})",
        "",
        f"Machine: {machine_line()}; device {args.device}; world {args.world_size} (no-op group, "
        f"communication free); {args.rounds} rounds, arm order reversed each round, {args.warmup} warm-up + "
        f"{args.steps} timed steps per arm and round. Ratios: median [min-max] of per-round ratios.",
        "",
        "| model | dtype | bare ms | torch ms | lockstep ms | replicate ms | lockstep/torch | replicate/torch "
        "| lockstep/bare | replicate/bare | torch/bare | noise (torch/torch) | engine CPU ms/step (torch / lockstep / replicate) "
        "| grad parity (max rel vs bare/W) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ms, cpu, par = row["ms"], row["engine_cpu_ms"], row["parity"]
        lines.append(
            f"| {row['model']} | {row['dtype']} | {ms['bare']:.2f} | {ms['torch']:.2f} | {ms['lockstep']:.2f} | "
            f"{ms['replicate']:.2f} | {row['lockstep/torch']} | {row['replicate/torch']} | {row['lockstep/bare']} | "
            f"{row['replicate/bare']} | {row['torch/bare']} | {row['noise']} | {cpu['torch']:.2f} / {cpu['lockstep']:.2f} / "
            f"{cpu['replicate']:.2f} | {max(par['torch'], par['lockstep'], par['replicate']):.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small_mlp", "many_small", "mlp", "resnet", "gpt"],
                        choices=["small_mlp", *MODELS])  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--out",
        default="",
        help="report path (default benchmarks/results/<date>-engine_overhead[_DEVICE].md)",
    )
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device).index or 0)  # "cuda" alone: device 0
    noop.init(args.world_size)
    suffix = "" if args.device == "cpu" else "_cuda"
    out = (
        Path(args.out)
        if args.out
        else ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-engine_overhead{suffix}.md"
    )
    rows = []
    for name in args.models:
        for dtype in args.dtypes:
            row = measure(name, dtype, args)
            rows.append(row)
            print(row, flush=True)
            out.write_text(report(rows, args))  # after every row: a run cut short keeps what it measured
    print(report(rows, args))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
