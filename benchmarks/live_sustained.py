"""Benchmark: throughput under repeated failures in live mode (issue 14: a kill every 30 s for 10 minutes).

The job of benchmarks/live_recovery_job.py (deterministic lockstep.fit of an MLP of --mb megabytes, Adam,
4 gloo ranks) runs under `lockstep run -n 4 --min-world 2 --max-restarts R` twice:

- fault-free, for --baseline-s seconds;
- with a SIGKILL every --every-s seconds for --duration-s seconds, each time to a random running worker
  (rank 0 included); each lost worker is replaced (R is large enough), so the world keeps coming back to 4.

Throughput is optimizer steps per second over the window from the first completed step to the end (the
launcher is interrupted at the end), read from the steps files the job writes. Reported: both rates and
their ratio, the kills, and the faults the run recorded.

    OMP_NUM_THREADS=1 python benchmarks/live_sustained.py --mb 20 --duration-s 600 --every-s 30
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_line  # noqa: E402

JOB = ROOT / "benchmarks" / "live_recovery_job.py"
MANY_STEPS = 50_000  # the job's length: it is interrupted long before


def _steps(out: Path) -> list[tuple[float, int]]:
    """(time, step) of every completed step, from every process (the highest step per time is the job's)."""
    rows = []
    for path in out.glob("steps-*.txt"):
        for line in path.read_text().splitlines():
            t, s = line.split()
            rows.append((float(t), int(s)))
    return sorted(rows)


def _running_pids(logs: Path) -> list[int]:
    pids = []
    for pid_file in logs.glob("rank*/pid"):
        pid = int(pid_file.read_text())
        if Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text():
            pids.append(pid)
    return pids


def run(out: Path, args: argparse.Namespace, duration: float, every: float | None) -> dict[str, float]:
    out.mkdir()
    logs = out / "logs"
    cmd = [sys.executable, "-m", "lockstep", "run", "-n", "4", "--min-world", "2", "--max-restarts", "1000"]
    job = [str(JOB), str(out), str(args.mb), str(MANY_STEPS), "0", "0"]
    with open(out / "launcher.log", "w") as fh:
        proc = subprocess.Popen([*cmd, "--run-dir", str(logs), *job], stdout=fh, stderr=fh, cwd=ROOT)
        kills = 0
        try:
            while not _steps(out):
                time.sleep(0.1)
            start = time.time()
            next_kill = start + every if every else float("inf")
            rng = random.Random(0)
            while time.time() < start + duration:
                if time.time() >= next_kill:
                    pids = _running_pids(logs)
                    if pids:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                        kills += 1
                    next_kill += every or 0
                time.sleep(0.05)
            end = time.time()
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    rows = [(t, s) for t, s in _steps(out) if start <= t <= end]
    first, last = min(s for _, s in rows), max(s for _, s in rows)
    return {"steps_per_s": (last - first) / (end - start), "kills": kills, "steps": last - first}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=20)
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--every-s", type=float, default=30)
    parser.add_argument("--baseline-s", type=float, default=120)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="live_sustained-") as tmp:
        base = run(Path(tmp) / "fault_free", args, args.baseline_s, None)
        faulty = run(Path(tmp) / "faulty", args, args.duration_s, args.every_s)
        launcher = (Path(tmp) / "faulty" / "launcher.log").read_text()
    lost = launcher.count("killed by SIGKILL;")
    joined = launcher.count("started, it joins at a step boundary")
    text = "\n".join(
        [
            f"# live mode under a kill every {args.every_s:g} s ({datetime.date.today()})",
            "",
            machine_line(),
            "",
            f"4 ranks, deterministic fit of a {args.mb} MB MLP (Adam), `--min-world 2 --max-restarts 1000`.",
            "",
            "| run | window | steps | steps/s | kills |",
            "|---|---|---|---|---|",
            f"| fault-free | {args.baseline_s:.0f} s | {base['steps']} | {base['steps_per_s']:.3f} | 0 |",
            f"| a SIGKILL every {args.every_s:g} s | {args.duration_s:.0f} s | {faulty['steps']} "
            f"| {faulty['steps_per_s']:.3f} | {faulty['kills']} |",
            "",
            f"Throughput kept: **{faulty['steps_per_s'] / base['steps_per_s']:.1%}** of the fault-free run's "
            f"(the launcher saw {lost} deaths and started {joined} replacements).",
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
