"""Benchmark: what a dead rank costs a job, live mode against restart-and-reload (issue 14).

The same deterministic job (benchmarks/live_recovery_job.py: an MLP of --mb megabytes of parameters, Adam,
4 gloo ranks) loses launch rank 2 to a SIGKILL in step --kill-step, three ways:

- `live`: `lockstep run --min-world 2`: the survivors re-form the group and redo the step;
- `replace`: the same, plus `--max-restarts 1`: a replacement starts, joins at a step boundary and receives
  the model and optimizer state (3x --mb: parameters and Adam's two moments) from rank 0;
- `restart`: `lockstep run --max-restarts 1`: torch's agent stops every worker, starts them again, and they
  reload the last checkpoint (every --checkpoint-every steps).

Reported per way: from the kill to the first step completed after it, and to the step that the job was in
when the rank died completed again (progress regained); steps done twice; the whole job's wall time; for
live mode the recovery broken down (how long the survivors waited in the failed collective, leaving the
old group, agreeing on the members, forming the new group); for the replacement, its start-up (process
start to its first step) and the state transfer.

    OMP_NUM_THREADS=1 python benchmarks/live_recovery.py --mb 100 --steps 24 --kill-step 10

--float runs the job without deterministic mode (live mode's float step: the engine's bucketed all-reduce).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_line  # noqa: E402

JOB = ROOT / "benchmarks" / "live_recovery_job.py"
WAYS = {
    "live": ("--min-world", "2"),
    "replace": ("--min-world", "2", "--max-restarts", "1"),
    "restart": ("--max-restarts", "1"),
}


def _steps(out: Path, uid: int) -> list[tuple[float, int]]:
    path = out / f"steps-{uid}.txt"
    if not path.exists():
        return []
    return [(float(t), int(s)) for t, s in (line.split() for line in path.read_text().splitlines())]


def run_way(way: str, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    out = base / way
    out.mkdir()
    cmd = [sys.executable, "-m", "lockstep", "run", "-n", "4", *WAYS[way], "--run-dir", str(out / "logs")]
    job = [str(JOB), str(out), str(args.mb), str(args.steps), str(args.kill_step), str(args.checkpoint_every)]
    job += ["float"] if args.float else []
    started = time.time()
    proc = subprocess.run([*cmd, *job], capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"{way}: lockstep run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    killed = float((out / "killed").read_text())
    rank0 = _steps(out, 0)
    after = [(t, s) for t, s in rank0 if t > killed]
    regained = next(t for t, s in after if s == args.kill_step)
    result: dict[str, Any] = {
        "way": way,
        "wall_s": round(wall, 2),
        "next_step_s": round(after[0][0] - killed, 3),
        "regained_s": round(regained - killed, 3),
        "steps_redone": len(rank0) - len({s for _, s in rank0}),
    }
    summary = json.loads((out / "run" / "summary.json").read_text())
    for fault in summary.get("faults") or []:
        if fault["kind"] == "lost":
            result["recovery"] = {"recover_s": fault["recover_s"], **fault["detail"]}
        else:
            uid = fault["joined"][0]
            start = float((out / f"started-{uid}").read_text())
            first = _steps(out, uid)[0][0]
            result["replacement"] = {
                "start_to_first_step_s": round(first - start, 3),
                "converge_s": fault["detail"].get("converge_s"),
                "joined_after_step": fault["step"],
            }
    result["world_at_end"] = summary["world_size"]
    result["params_sha256"] = summary["params_sha256"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=100, help="megabytes of parameters")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-step", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=8)
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--float", action="store_true", help="not in deterministic mode")
    parser.add_argument("--out", default=None, help="write the markdown report here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_way(way, args, Path(tmp)) for way in args.ways]
    lines = [
        f"# live recovery vs restart ({datetime.date.today()})",
        "",
        machine_line(),
        f"job: 4 ranks, MLP of {args.mb} MB parameters, Adam, {'float sums' if args.float else 'deterministic'}, "
        f"{args.steps} steps, launch rank 2 "
        f"SIGKILLed in step {args.kill_step}, checkpoints every {args.checkpoint_every} steps",
        "",
        "| way | kill to next step (s) | kill to the lost step done (s) | steps done twice | job wall (s) | world at end |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['way']} | {r['next_step_s']} | {r['regained_s']} | {r['steps_redone']} | {r['wall_s']} "
            f"| {r['world_at_end']} |"
        )
    lines.append("")
    for r in results:
        if "recovery" in r:
            lines.append(f"- {r['way']}: recovery {json.dumps(r['recovery'])}")
        if "replacement" in r:
            lines.append(f"- {r['way']}: replacement {json.dumps(r['replacement'])}")
    same = {r["params_sha256"] for r in results}
    lines.append(f"- final parameters bitwise equal across the ways: {len(same) == 1}")
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
