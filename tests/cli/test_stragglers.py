"""Straggler reports end to end: a rank made slower in its data loading is named, with that phase, within
30 steps of the slowdown's start; a balanced run names nobody.

tests/cli/straggler_program.py runs on 2 gloo ranks under `lockstep run -n 2` (and under plain torchrun)
with a 3 s hang timeout (a heartbeat every 0.3 s: each one carries the rank's straggler summary). Rank 0
prints one warning line and lockstep.runtime.stragglers() returns the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import child_env, run_cli

PROGRAM = Path(__file__).with_name("straggler_program.py")
SLOW_FROM = 20  # the program's SLOW_FROM
LINE = "[rank 0/2] WARNING lockstep.stragglers: rank 1 (host "


def _lockstep_run(tmp_path: Path, case: str, steps: int) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "run", "-n", "2", "--hang-timeout", "3", str(PROGRAM), case, str(tmp_path), str(steps),
        cwd=tmp_path, timeout=180,
    )  # fmt: skip


def _torchrun(tmp_path: Path, case: str, steps: int) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:0", str(PROGRAM), case, str(tmp_path), str(steps),
    ]  # fmt: skip
    env = child_env(LOCKSTEP_HANG_TIMEOUT="3")
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)


def _results(tmp_path: Path, proc: subprocess.CompletedProcess[str]) -> dict[int, dict[str, Any]]:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return {r: json.loads((tmp_path / f"result-{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.smoke
@pytest.mark.parametrize("launcher", [pytest.param(_lockstep_run, id="lockstep-run")])
def test_a_rank_slow_in_data_loading_is_named_with_that_phase(tmp_path: Path, launcher: Any) -> None:
    proc = launcher(tmp_path, "slow", 80)
    results = _results(tmp_path, proc)
    output = proc.stdout + proc.stderr
    rank0 = results[0]
    assert rank0["named_at"] is not None, output[-4000:]
    assert SLOW_FROM < rank0["named_at"] <= SLOW_FROM + 30, rank0
    reports = rank0["reports"]
    assert len(reports) == 1, reports
    report = reports[0]
    assert report["rank"] == 1 and report["phase"] == "data loading", report
    assert report["factor"] >= 1.2 and 20.0 <= report["excess_ms"] <= 60.0, report
    assert report["first_step"] <= report["last_step"] and report["last_step"] > SLOW_FROM, report
    assert results[1]["reports"] == []  # only rank 0 judges
    lines = [line for line in output.splitlines() if "lockstep.stragglers" in line]
    assert len(lines) == 1, lines  # one line when it starts, none while it lasts
    assert lines[0].startswith(LINE) and "is a straggler: " in lines[0], lines
    assert "the faster rank's busy time (rank 0)" in lines[0] and "ms/step in data loading" in lines[0], lines


def test_under_plain_torchrun_rank_0_prints_the_report(tmp_path: Path) -> None:
    proc = _torchrun(tmp_path, "slow", 80)
    results = _results(tmp_path, proc)
    assert results[0]["reports"] and results[0]["reports"][0]["phase"] == "data loading", results
    output = proc.stdout + proc.stderr
    assert LINE in output and "ms/step in data loading" in output, output[-4000:]


def test_a_straggler_is_named_in_a_sharded_run(tmp_path: Path) -> None:
    """FSDP2's collectives (lockstep.shard) carry the waits: the slow rank and its phase are named."""
    proc = _lockstep_run(tmp_path, "sharded_slow", 80)
    results = _results(tmp_path, proc)
    rank0 = results[0]
    assert rank0["named_at"] is not None, (proc.stdout + proc.stderr)[-4000:]
    assert SLOW_FROM < rank0["named_at"] <= SLOW_FROM + 30, rank0
    assert rank0["reports"][0]["rank"] == 1 and rank0["reports"][0]["phase"] == "data loading", rank0


def test_a_balanced_run_names_nobody(tmp_path: Path) -> None:
    proc = _lockstep_run(tmp_path, "balanced", 200)
    results = _results(tmp_path, proc)
    assert results[0]["reports"] == [] and results[0]["named_at"] is None, results
    assert "lockstep.stragglers" not in proc.stdout + proc.stderr
