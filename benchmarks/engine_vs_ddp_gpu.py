"""Benchmark: lockstep's engine against torch's DistributedDataParallel on one CUDA GPU (NCCL, world size 1).

With one GPU the all-reduce is trivial, so this measures what a Python engine adds to a GPU step: its
autograd hooks, bucket copies and the CPU time to launch them, which a fast GPU exposes where a 2-core
CPU hides it. Same protocol as engine_vs_ddp.py: identical weights and data, a gradient parity check,
A-B-B-A rounds of warm-up then timed steps (CUDA synchronized), median of per-round ratios with min-max;
torch against torch gives the noise floor. Peak GPU memory of a step per engine (allocator peak above
the memory held before the step).

    python benchmarks/engine_vs_ddp_gpu.py --rounds 6 --steps 30
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

import torch  # noqa: E402
from benchmarks.common import MODELS, abba, batch, build, fmt_ratios, loss  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import lockstep  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

DEVICE = torch.device("cuda", 0)


class _Engine:
    def __init__(self, kind: str, name: str, state: dict[str, torch.Tensor], precision: str) -> None:
        self.module = build(name).to(DEVICE)
        self.module.load_state_dict(state)
        cls = lockstep.DistributedDataParallel if kind == "lockstep" else TorchDDP
        self.model = cls(self.module, device_ids=[0])
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4)
        self.name = name
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.batches = [tuple(t.to(DEVICE) for t in batch(name, 0, step)) for step in range(4)]

    def step(self, step: int) -> None:
        x, y = self.batches[step % len(self.batches)]
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=self.dtype, enabled=self.dtype is not None):
            out = self.model(x)
        loss(self.name, out.float(), y).backward()
        self.opt.step()


def _seconds(engine: _Engine, warmup: int, steps: int) -> float:
    for i in range(warmup):
        engine.step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        engine.step(warmup + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _peak_bytes(engine: _Engine) -> int:
    engine.opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.step(0)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - held


def _parity(a: _Engine, b: _Engine) -> float:
    for engine in (a, b):
        engine.step(0)
    worst = 0.0
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        scale = float(pb.grad.abs().max()) or 1.0
        worst = max(worst, float((pa.grad - pb.grad).abs().max()) / scale)
    return worst


def _measure(name: str, precision: str, rounds: int, warmup: int, steps: int) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = True
    state = build(name).state_dict()
    engines = {
        "lockstep": _Engine("lockstep", name, state, precision),
        "torch": _Engine("torch", name, state, precision),
        "torch2": _Engine("torch", name, state, precision),
    }
    parity = _parity(engines["lockstep"], engines["torch"])
    ratios, floor, times = [], [], {k: [] for k in engines}
    for r in range(rounds):
        seen = {}
        for kind in abba(list(engines), r):
            seen.setdefault(kind, []).append(_seconds(engines[kind], warmup, steps))
        for kind, values in seen.items():
            times[kind].append(statistics.mean(values))
        ratios.append(times["lockstep"][-1] / times["torch"][-1])
        floor.append(times["torch2"][-1] / times["torch"][-1])
    return {
        "parity": parity,
        "ratios": ratios,
        "floor": floor,
        "ms": {k: 1000 * statistics.median(v) for k, v in times.items()},
        "peak_mb": {k: _peak_bytes(engines[k]) / 2**20 for k in ("lockstep", "torch")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("engine_vs_ddp_gpu: needs a CUDA device (torch.cuda.is_available() is False)")
    lines = [
        f"# lockstep vs torch DDP on one GPU ({datetime.date.today()})",
        "",
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL world size 1; "
        f"{args.rounds} A-B-B-A rounds of {args.warmup} warm-up + {args.steps} timed steps",
        "",
        "| model | precision | lockstep ms | torch ms | ratio lockstep/torch (median [min-max]) "
        "| noise floor torch/torch | peak MB lockstep | peak MB torch | grad parity (rel) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        for precision in args.precisions:
            result = run_distributed(
                _measure,
                1,
                args=(name, precision, args.rounds, args.warmup, args.steps),
                backend="nccl",
                timeout=600,
            )[0]
            lines.append(
                f"| {name} | {precision} | {result['ms']['lockstep']:.2f} | {result['ms']['torch']:.2f} "
                f"| {fmt_ratios(result['ratios'])} | {fmt_ratios(result['floor'])} "
                f"| {result['peak_mb']['lockstep']:.1f} | {result['peak_mb']['torch']:.1f} "
                f"| {result['parity']:.1e} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
