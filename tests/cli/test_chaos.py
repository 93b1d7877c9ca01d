"""Live mode through repeated faults: one seeded chaos schedule of every kind of fault (tools/chaos.py).

The digits job on 4 ranks with replacements meets ten faults a few seconds apart, one of each kind the
tool strikes: SIGKILL of a member and of rank 0, SIGSTOP, a straggler evicted, two members killed within
one recovery, a member stopped while the others re-form after a kill, a replacement killed as it queues, once admitted and while it receives its state, and rank
0 killed while its background checkpoint write is in flight. The job must exit 0 with a summary, the
fault-free run's parameter and optimizer bits (deterministic mode), and every member struck in the
record. `python tools/chaos.py --seeds 50` runs more seeds at will.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 960  # the fault-free run (4500 steps, on 1 rank) and the seed: about 4 minutes on 2 cores
KINDS = {
    "kill",
    "kill_rank0",
    "stop",
    "straggler",
    "double",
    "stop_in_recovery",
    "joiner_queued",
    "joiner_admitted",
    "joiner_healing",
    "checkpoint_rank0",
}


@pytest.mark.timeout(RUN_TIMEOUT + 120)
def test_a_schedule_of_every_kind_of_fault_ends_with_the_fault_free_bits(tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    cmd = [sys.executable, str(ROOT / "tools" / "chaos.py"), "--seeds", "1", "--first", "1", "--faults", "10"]
    cmd += ["--steps", "4500", "--gap", "1", "4", "--workdir", str(tmp_path / "runs"), "--json", str(report)]
    cmd += ["--reference-ranks", "1"]  # the fault-free bits (the same at any world size), sooner
    result = _run_tool(cmd)
    assert report.exists(), result.stdout + result.stderr
    [seed] = json.loads(report.read_text())
    struck = {s["kind"]: s for s in seed["strikes"]}
    assert set(struck) == KINDS, seed["strikes"]
    assert all(s["victims"] for s in struck.values()), seed["strikes"]  # every fault landed
    for kind in ("double", "stop_in_recovery", "joiner_healing"):
        assert len(struck[kind]["victims"]) == 2, struck[kind]
    assert seed["exit_code"] == 0, result.stdout[-4000:]
    assert seed["summary"] and seed["same_bits"] and seed["recorded"], seed["why"]
    assert seed["passed"] and result.returncode == 0, result.stdout[-4000:]
    lost = sorted(m for record in seed["faults"] for m in record["lost"])
    assert (
        len(lost) >= 10
    )  # each fault a member lost (a queued replacement is no member: in the launcher's lines)
    # The run's account: nothing lost from a counted step, and the time of every fault somewhere in it
    assert seed["samples_lost"] == 0 and 0 < seed["goodput"] < 1, seed
    causes = seed["lost_s_by_cause"]
    assert causes["reformation"] > 0 and causes["hang_detection"] > 0 and causes["state_transfer"] > 0, causes
    # The trace: a track for every launched member (a struck one's ends where it died), every loss marked
    run = tmp_path / "runs" / "seed1" / "run"
    trace = json.loads((run / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    members = {int(name.split()[1]) for name in tracks}
    assert set(range(4)) <= members, tracks
    fault_steps = {m["args"]["step"] for m in trace["traceEvents"] if m["ph"] == "i" and m["cat"] == "fault"}
    assert {r["step"] for r in seed["faults"] if r["lost"]} <= fault_steps, (fault_steps, seed["faults"])
    assert (run / "timeline.png").stat().st_size > 10_000


def _run_tool(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run the tool; past RUN_TIMEOUT it gets SIGTERM, on which it stops its job (nothing left running)."""
    with subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.terminate()
            out, err = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
