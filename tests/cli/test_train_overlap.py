"""`lockstep train ... --overlap-optimizer true` end to end: the same bits as without, or the plain step
with its reason said once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers import lockstep_cli

TOY = ("toy", "-n", "2", "--num-samples", "512", "--batch-size", "16", "--max-steps", "12")
TOY += ("--lr-schedule", "cosine", "--warmup-steps", "3", "--progress", "none")


def _train(run_dir: Path, *extra: str) -> tuple[dict, subprocess.CompletedProcess[str]]:
    proc = lockstep_cli("train", *TOY, "--run-dir", str(run_dir), *extra, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "summary.json").read_text()), proc


def test_overlap_optimizer_gives_the_bits_of_the_plain_step(tmp_path: Path) -> None:
    plain, _ = _train(tmp_path / "plain", "--grad-accum-steps", "2")
    overlapped, proc = _train(
        tmp_path / "overlapped", "--grad-accum-steps", "2", "--overlap-optimizer", "true"
    )
    assert json.loads((tmp_path / "overlapped" / "config.json").read_text())["overlap_optimizer"] is True
    assert overlapped["steps"] == plain["steps"] == 12
    assert overlapped["params_sha256"] == plain["params_sha256"]
    assert overlapped["optimizer_sha256"] == plain["optimizer_sha256"]
    assert "overlap_optimizer:" not in proc.stdout + proc.stderr  # no fallback to report


def test_overlap_optimizer_with_clipping_says_why_it_keeps_the_plain_step(tmp_path: Path) -> None:
    plain, _ = _train(tmp_path / "plain", "--clip-grad-norm", "0.5")
    clipped, proc = _train(tmp_path / "clipped", "--clip-grad-norm", "0.5", "--overlap-optimizer")
    assert clipped["params_sha256"] == plain["params_sha256"]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "overlap_optimizer:" in line]
    assert said and all("gradient clipping by global norm needs every gradient" in line for line in said), (
        said
    )
    assert len([line for line in said if "[rank 0/2]" in line]) == 1, said
