"""Benchmark: sharded replica groups that meet every H steps against HSDP's every-step all-reduce (issue 46).

The gpt job through `lockstep train` (the README's path), 4 ranks as 2 replica groups of FSDP 2
(`--shard-degree 2`), the same steps, batch and data in every arm:

- `hsdp`: the groups average every step (FSDP2's HSDP: a reduce-scatter inside each group, then an
  all-reduce of each shard across the groups);
- `local_sgd`, `diloco`, `streaming_diloco`: `--sync ... --sync-every H`: FSDP2 inside each group, the groups
  meeting every H steps on their shards (streaming: `--fragments 2`).

Reported per arm from each run's summary.json: the final eval loss (the job's evaluation at the run's end),
its ratio to hsdp's, the bytes each rank sent between the groups (`comm_bytes`) and inside its group
(`comm_bytes_in_group`), the ratio of hsdp's bytes between groups to the arm's, and the wall time of the
training (median of the runs; arms interleaved run by run, so that a slower moment of the machine falls on
every arm alike). The issue's targets: diloco's eval loss <= 1.10x hsdp's, >= 5x fewer bytes between groups.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sharded_sync.py --steps 60 --batch 16 --sync-every 10 \\
        --runs 1 --out benchmarks/results/2026-11-29-sharded_sync.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_line, write_report  # noqa: E402

ARMS = {
    "hsdp": (),
    "local_sgd": ("--sync", "local_sgd"),
    "diloco": ("--sync", "diloco"),
    "streaming_diloco": ("--sync", "streaming_diloco", "--fragments", "2"),
}


def run_arm(arm: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One `lockstep train gpt` run of the arm; its summary.json."""
    periodic = ("--sync-every", str(args.sync_every)) if ARMS[arm] else ()
    cmd = [sys.executable, "-m", "lockstep", "train", "gpt", "-n", str(args.world), "--shard-degree", "2"]
    cmd += [*ARMS[arm], *periodic, "--batch-size", str(args.batch), "--max-steps", str(args.steps)]
    cmd += ["--progress", "lines", "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{arm}: exit {done.returncode}\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


def table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    base = results["hsdp"][0]
    rows = [
        "| arm | final eval loss | loss vs hsdp | bytes between groups / rank | hsdp's / this | bytes inside "
        "a group / rank | training wall s (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, runs in results.items():
        first = runs[0]
        between = first["comm_bytes"]
        fewer = f"{base['comm_bytes'] / between:.1f}x" if between else "-"
        wall = statistics.median(r["wall_time_s"] for r in runs)
        rows.append(
            f"| {arm} | {first['eval_loss']:.4f} | {first['eval_loss'] / base['eval_loss']:.3f}x | {between:,} | "
            f"{fewer} | {first['comm_bytes_in_group']:,} | {wall:.1f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--runs", type=int, default=1, help="runs of every arm, interleaved")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/<today>-sharded_sync.md")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {
        arm: [] for arm in ["hsdp", *[a for a in args.arms if a != "hsdp"]]
    }
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for arm in results:
                results[arm].append(run_arm(arm, args, Path(tmp) / f"{arm}-{run}"))
                print(f"run {run}: {arm} done", flush=True)
    lines = [
        f"# Sharded replica groups meeting every H steps against HSDP ({datetime.date.today()})",
        "",
        f"Machine: {machine_line()}. The gpt job (`lockstep train gpt`), {args.world} ranks as "
        f"{args.world // 2} replica groups of FSDP 2 (`--shard-degree 2`), {args.steps} steps of batch "
        f"{args.batch} per rank, H = {args.sync_every} (`--sync-every`); streaming DiLoCo with 2 fragments. "
        f"{args.runs} run(s) of every arm, interleaved.",
        "",
        *table(results),
        "",
        f"Command: `OMP_NUM_THREADS=1 python benchmarks/sharded_sync.py --steps {args.steps} --batch {args.batch} "
        f"--sync-every {args.sync_every} --runs {args.runs}`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(text, "sharded_sync", str(args.out or ""))


if __name__ == "__main__":
    main()
