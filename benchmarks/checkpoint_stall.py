"""Benchmark: how long a checkpoint stops training, blocking against background (issue 36).

Two gloo ranks train one of benchmarks.common's models (the 25M-parameter MLP, the GPT) with AdamW through
lockstep's DistributedDataParallel and save every `--every` steps with CheckpointManager, in rounds whose
order alternates (A-B-B-A): blocking saves (`save(step, state)`), background saves
(`save(step, state, blocking=False)`, the end of the round waiting for the last write) and no saves (the
reference). Per round and mode:

- stall per save: the seconds the slowest rank spent in save(), every rank entering it together (a barrier,
  untimed, before each save), divided by the saves: what the save itself costs; the ratio
  background/blocking is the target (<= 0.10). Without the barrier a rank that reaches the save first
  would wait in its first collective for the others (`CheckpointManager.stall_s` counts that too): a skew
  between the ranks' steps (on 2 cores, rank 0's writer thread slows rank 0's steps) that the next gradient
  all-reduce would wait out anyway, and that the ms/step columns show. The first background save of a run
  also allocates the CPU copy's buffers (once per run, in the warm-up round here): reported apart, as is
  the wait for the last write at the end of the round (which a run pays once, at its end);
- the round's wall time per step against the round without saves: what the writes cost training in all
  (on 2 cores the writer thread competes with the ranks for the CPU);
- the CPU memory a background save keeps (`cpu_copy_bytes`, rank 0) and each mode's peak RSS.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_stall.py --models mlp gpt --rounds 4
"""

from __future__ import annotations

import argparse
import resource
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
from benchmarks.common import abba, batch, build, fmt_ratios, loss, machine_line, write_report  # noqa: E402

import lockstep  # noqa: E402
from lockstep.checkpoint import CheckpointManager  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

MODES = ("blocking", "background", "none")


def _round(
    name: str, model: Any, optimizer: Any, mode: str, steps: int, every: int, manager: CheckpointManager
) -> dict[str, float]:
    rank = dist.get_rank()
    manager.stall_s = 0.0
    saves, aligned = 0, 0.0
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x, y = batch(name, rank, step)
        optimizer.zero_grad()
        loss(name, model(x), y).backward()
        optimizer.step()
        if mode != "none" and step % every == 0:
            dist.barrier()  # every rank enters the save together: what follows is the save's own cost
            entered = time.perf_counter()
            manager.save(
                step, {"model": model, "optimizer": optimizer, "step": step}, blocking=mode == "blocking"
            )
            aligned += time.perf_counter() - entered
            saves += 1
    in_saves = manager.stall_s
    manager.wait()  # the end of a run: the last write (counted apart: a long run pays it once)
    dist.barrier()
    wall = time.perf_counter() - start
    measured = torch.tensor([aligned, manager.stall_s - in_saves, wall], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)  # the slowest rank's
    return {
        "stall_per_save": float(measured[0]) / max(saves, 1),
        "final_wait": float(measured[1]),
        "ms_per_step": float(measured[2]) / steps * 1e3,
        "copy_mib": manager.cpu_copy_bytes / 2**20,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _worker(name: str, rounds: int, steps: int, every: int, root: str) -> dict[str, Any]:
    model = lockstep.DistributedDataParallel(build(name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    # One manager per mode for the whole benchmark, as a run has one: the background manager's CPU buffers
    # are allocated at its first save, once per run, in the warm-up round (buckets rebuilt, state allocated).
    managers = {mode: CheckpointManager(f"{root}/{mode}", keep=1) for mode in MODES}
    first = _round(name, model, optimizer, "background", every, every, managers["background"])
    for r in range(rounds):
        for mode in abba(MODES[:2], r) + ["none"]:
            results[mode].append(_round(name, model, optimizer, mode, steps, every, managers[mode]))
    return {"results": results, "first_save": first["stall_per_save"]}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="steps per round and mode")
    parser.add_argument("--every", type=int, default=4, help="steps between saves")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    lines = [
        "# Checkpoint stall: blocking against background saves",
        "",
        machine_line(),
        f"world 2, AdamW, a save every {args.every} steps, {args.steps} steps per round and mode, "
        f"{args.rounds} rounds (blocking and background A-B-B-A, then no saves)",
        "",
        "| model | stall per save, blocking (s) | background (s) | background / blocking | "
        "first background save (s) | end wait (s) | "
        "ms/step: none | blocking | background | CPU copy (MiB) | peak RSS rank 0 (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix="ckpt-stall-") as root:
            out = run_distributed(
                _worker, 2, args=(name, args.rounds, args.steps, args.every, root), timeout=3600
            )[0]
        zero = out["results"]
        blocking = [r["stall_per_save"] for r in zero["blocking"]]
        background = [r["stall_per_save"] for r in zero["background"]]
        ratios = [b / a for a, b in zip(blocking, background)]
        ms = {mode: statistics.median(r["ms_per_step"] for r in zero[mode]) for mode in MODES}
        lines.append(
            f"| {name} | {statistics.median(blocking):.3f} | {statistics.median(background):.3f} | "
            f"{fmt_ratios(ratios)} | {out['first_save']:.3f} | {statistics.median(r['final_wait'] for r in zero['background']):.3f} | "
            f"{ms['none']:.0f} | {ms['blocking']:.0f} | {ms['background']:.0f} | "
            f"{max(r['copy_mib'] for r in zero['background']):.0f} | {max(r['rss_mib'] for r in zero['background']):.0f} |"
        )
        print(lines[-1], flush=True)
    write_report("\n".join(lines) + "\n", "checkpoint_stall", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
