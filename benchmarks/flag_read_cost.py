"""Diagnostic: what the missing-gradient flag's read costs a step (issue 27's CUDA suspect).

After each synced backward the drop-in class reads one element of the last reduced bucket (`.item()`:
engine/buckets/unused.py, `UnusedAgreement.read`) to agree, on every rank, whether some parameter had no gradient.
On a GPU that read waits for the device: a synchronisation per step that torch's DDP does not make, and the
first suspect for the 1.37x the issue measured on small, fast steps on an H200. This script times, on the
no-op process group of benchmarks/engine_overhead.py, torch's DDP against lockstep's drop-in class as it is
and against the same class with the read replaced by a constant (a measurement only: that arm would miss a
real missing gradient), in alternating rounds. The difference between the two lockstep arms is the read's
cost; on a CPU it is a few microseconds, on a GPU it is the synchronisation.

    python benchmarks/flag_read_cost.py --device cuda --models mlp small_mlp      # on a GPU machine
    OMP_NUM_THREADS=1 python benchmarks/flag_read_cost.py --models small_mlp       # the CPU reference
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from benchmarks import noop_group  # noqa: E402
from benchmarks.common import fmt_ratios, machine_line, round_order  # noqa: E402
from benchmarks.engine_overhead import DTYPES, Arm, _model  # noqa: E402

from lockstep.engine.buckets.unused import UnusedAgreement  # noqa: E402

ARMS = ("torch", "lockstep", "lockstep_no_read")
_READ = UnusedAgreement.read


def _no_read(
    self: UnusedAgreement, reduced: torch.Tensor, count: int, missing: list[int], signal: str
) -> str:
    return ""  # what the read returns when no rank missed a gradient, without looking at the device


def _timed(arm: Arm, kind: str, warmup: int, steps: int, start: int) -> float:
    UnusedAgreement.read = _no_read if kind == "lockstep_no_read" else _READ  # type: ignore[method-assign]
    try:
        return arm.timed(warmup, steps, start)[0]
    finally:
        UnusedAgreement.read = _READ  # type: ignore[method-assign]


def measure(name: str, dtype: str, args: argparse.Namespace) -> str:
    state = _model(name).to(dtype=DTYPES[dtype]).state_dict()
    arms = {kind: Arm("lockstep" if kind.startswith("lockstep") else kind, name, state, DTYPES[dtype], args.device)
            for kind in ARMS}  # fmt: skip
    times: dict[str, list[float]] = {kind: [] for kind in ARMS}
    for r in range(args.rounds):
        for kind in round_order(ARMS, r):
            times[kind].append(_timed(arms[kind], kind, args.warmup, args.steps, start=r * 1000))
    ms = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}

    def ratios(a: str, b: str) -> str:
        return fmt_ratios([x / y for x, y in zip(times[a], times[b])])

    return (
        f"| {name} | {dtype} | {ms['torch']:.3f} | {ms['lockstep']:.3f} | {ms['lockstep_no_read']:.3f} | "
        f"{ratios('lockstep', 'torch')} | {ratios('lockstep_no_read', 'torch')} | "
        f"{(ms['lockstep'] - ms['lockstep_no_read']) * 1e3:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small_mlp", "mlp"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the table to this path")
    args = parser.parse_args()
    noop_group.init(args.world_size)
    lines = [
        f"# The missing-gradient flag's read, per step ({machine_line()}; device {args.device}; no-op group, "
        f"world {args.world_size}; {args.rounds} rounds x {args.steps} steps)",
        "",
        "| model | dtype | torch ms | lockstep ms | lockstep without the read ms | lockstep/torch "
        "| without the read/torch | the read, us/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        for dtype in args.dtypes:
            lines.append(measure(name, dtype, args))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
