"""Background checkpoints in live mode: the writing rank (rank 0) is SIGKILLed half-way through a background
write while training goes on. The survivors re-form without a restart, the new rank 0 finds that
checkpoint incomplete on disk and drops it (the one before it stays loadable), later checkpoints are
written by the new rank 0, and the run ends with the bits of a fault-free run; a second launch resumed
from the checkpoint before the lost one ends with the same bits too.

The program is tests/cli/live_program.py in deterministic mode, 8 epochs of 8 steps, a checkpoint at the end
of every epoch, `FitConfig(checkpoint_async=True)`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from lockstep.checkpoint.meta import validate
from tests.helpers import run_live_program

STEPS, LOST = 64, 16  # rank 0 dies writing the checkpoint of step 16 (the second epoch's end)


def _run(out: Path, *launch: str, fault: str = "none") -> Any:
    return run_live_program(out, launch, fault, 0, LOST, ("long", "async"), timeout=240)


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "run" / "summary.json").read_text())


def _rank_logs(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((out / "logs").rglob("*.log")))


def test_the_writer_lost_mid_background_write_drops_that_checkpoint_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    ref = tmp_path / "ref"
    result = _run(ref, "-n", "2")
    assert result.returncode == 0, result.stderr
    reference = _summary(ref)
    assert reference["steps"] == STEPS and reference["checkpoints_written"] == STEPS // 8

    out = tmp_path / "lost"
    result = _run(out, "-n", "3", "--min-world", "2", fault="write")
    assert result.returncode == 0, result.stderr
    assert "lockstep run: rank 0 killed by SIGKILL; 2 of 3 ranks go on" in result.stderr, result.stderr
    assert "finished on 2 of 3 ranks, without a restart" in result.stderr, result.stderr
    summary = _summary(out)
    assert summary["restarts"] == 0 and summary["steps"] == STEPS
    [record] = summary["faults"]
    assert record["lost"] == [0], record
    # The bits of the fault-free run: nothing was lost with the writer.
    assert summary["params_sha256"] == reference["params_sha256"]
    assert summary["optimizer_sha256"] == reference["optimizer_sha256"]
    # The new rank 0 found the lost write incomplete and said so; the checkpoints around it are whole.
    logs = _rank_logs(out) + result.stderr
    assert f"checkpoint step_{LOST:06d} was being written by a rank that is gone and is incomplete" in logs, (
        logs[-4000:]
    )
    checkpoints = out / "run" / "checkpoints"
    assert validate(checkpoints / "step_000008", 8) is None
    assert validate(checkpoints / f"step_{STEPS:06d}", STEPS) is None
    assert not (checkpoints / f"step_{LOST:06d}").exists()

    # A second launch from the checkpoint before the lost one (as after a crash there) ends the same.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(checkpoints / "step_000008", resumed / "run" / "checkpoints" / "step_000008")
    result = _run(resumed, "-n", "2")
    assert result.returncode == 0, result.stderr
    again = _summary(resumed)
    assert again["steps_this_run"] == STEPS - 8, again  # resumed at step 8
    assert again["params_sha256"] == reference["params_sha256"]
    assert again["optimizer_sha256"] == reference["optimizer_sha256"]
