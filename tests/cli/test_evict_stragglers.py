"""`lockstep run --min-world M --evict-stragglers FACTOR`: a rank persistently slower than the others is
evicted as if it had failed, and the survivors finish without a restart, with nothing lost.

The program is tests/cli/live_program.py in deterministic mode (64 steps, each forward paced at 20 ms); the
straggler's forwards take 40 ms from its first forward on, about 2x the others' busy time. Deterministic
mode gives the strongest check: the survivors must end with the bits of a fault-free run at the smaller world.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import LIVE_PROGRAM, run_cli, run_live_program

STEPS = 8 * 192 // 24  # "long": 8 epochs of 192 samples, global batch 24


def _run(tmp_path: Path, name: str, *launch: str, fault: str = "none", victim: int = 0) -> Any:
    out = tmp_path / name
    return out, run_live_program(out, launch, fault, victim, 1, ("long", "paced"), timeout=240)


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "run" / "summary.json").read_text())


def test_a_rank_2x_slower_is_evicted_and_the_survivors_match_a_fault_free_run(tmp_path: Path) -> None:
    ref, result = _run(tmp_path, "ref", "-n", "2")
    assert result.returncode == 0, result.stderr
    reference = _summary(ref)
    assert reference["steps"] == STEPS and reference["faults"] == []

    launch = ("-n", "3", "--min-world", "2", "--hang-timeout", "10", "--evict-stragglers", "1.5")
    out, result = _run(tmp_path, "evict", *launch, fault="straggle", victim=1)
    assert result.returncode == 0, result.stderr
    assert "lockstep.stragglers: evicting rank 1: a straggler:" in result.stderr, result.stderr
    assert "lockstep run: rank 1 evicted by the survivors (a straggler:" in result.stderr, result.stderr
    assert "finished on 2 of 3 ranks, without a restart" in result.stderr, result.stderr
    summary = _summary(out)
    assert summary["restarts"] == 0 and summary["world_size"] == 2
    assert summary["steps"] == STEPS
    [record] = summary["faults"]
    assert record["lost"] == [1], record
    how = record["how"]["1"]
    assert how.startswith("evicted by the survivors (a straggler: "), how
    assert "--evict-stragglers 1.5" in how and "in forward" in how, how
    factor = float(how.split("a straggler: ")[1].split("x ")[0])
    assert factor >= 1.5, how
    # Evicted once windows of its slow steps were judged over the factor twice in a row (about step 20 on
    # a quiet machine; later when other jobs load the cores), with a quarter of the run left to the others.
    assert record["step"] <= STEPS * 3 // 4, record
    # Nothing lost: the bits of the fault-free run at the smaller world.
    assert summary["params_sha256"] == reference["params_sha256"]
    assert summary["optimizer_sha256"] == reference["optimizer_sha256"]
    for uid in (0, 2):  # the survivors kept their processes
        assert (out / f"pid-{uid}").read_text() == (out / f"done-{uid}").read_text()
    assert not (out / "done-1").exists()


def test_a_straggler_is_not_evicted_below_the_min_world(tmp_path: Path) -> None:
    launch = ("-n", "2", "--min-world", "2", "--hang-timeout", "10", "--evict-stragglers", "1.5")
    out, result = _run(tmp_path, "kept", *launch, fault="straggle", victim=1)
    assert result.returncode == 0, result.stderr
    assert "but is not evicted: 1 ranks would remain, fewer than --min-world 2" in result.stderr, (
        result.stderr
    )
    assert result.stderr.count("is not evicted") == 1, result.stderr  # said once
    summary = _summary(out)
    assert summary["faults"] == [] and summary["world_size"] == 2 and summary["steps"] == STEPS
    reports = summary["stragglers"]  # one episode, or more where a burst of load on the machine split it
    assert reports and {r["rank"] for r in reports} == {1}, reports
    assert any(r["phase"] == "forward" and r["factor"] >= 1.5 for r in reports), reports


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--evict-stragglers", "2"), "--evict-stragglers needs live mode"),
        (("--min-world", "1", "--evict-stragglers", "1"), "--evict-stragglers must be a factor > 1"),
        (("--min-world", "1", "--evict-stragglers", "x"), "--evict-stragglers expects a number"),
    ],
)
def test_the_launcher_refuses_a_bad_eviction_setting(
    tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    result = run_cli("run", "-n", "2", *flags, str(LIVE_PROGRAM), cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
