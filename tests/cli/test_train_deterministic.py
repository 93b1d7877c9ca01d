"""`lockstep train --deterministic` end to end: a run resized 4 -> 2 -> 3 equals a world of 1, by `lockstep compare`;
the toy job stopped on 2 ranks and resumed on 1 equals its uninterrupted run (the fast tier's smoke)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import lockstep_cli

# A constant learning rate: each leg's --max-steps (where it stops) does not shape the schedule.
SETTINGS = ("--deterministic", "--global-batch-size", "48", "--micro-batch-size", "8", "--epochs", "2")
SETTINGS += ("--lr-schedule", "constant", "--progress", "none")


def _train(run_dir: Path, nproc: int, *extra: str) -> dict:
    proc = lockstep_cli("train", "digits", "-n", str(nproc), "--run-dir", str(run_dir), *SETTINGS, *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "summary.json").read_text())


def test_a_run_resized_4_2_3_mid_epoch_is_bitwise_the_single_process_run(tmp_path: Path) -> None:
    whole = _train(tmp_path / "whole", 1)
    resized = tmp_path / "resized"
    steps_per_epoch = 1437 // 48  # the digits training split, whole steps of the global batch
    _train(resized, 4, "--max-steps", str(steps_per_epoch // 2))
    _train(resized, 2, "--max-steps", str(steps_per_epoch + 5))
    last = _train(resized, 3)
    assert last["world_size"] == 3 and last["steps"] == whole["steps"] == 2 * steps_per_epoch
    assert last["deterministic"] is True and last["global_batch_size"] == 48 and last["micro_batch_size"] == 8
    assert last["params_sha256"] == whole["params_sha256"]
    assert last["optimizer_sha256"] == whole["optimizer_sha256"]
    assert last["test_accuracy"] == whole["test_accuracy"]
    same = lockstep_cli("compare", str(tmp_path / "whole"), str(resized))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "bitwise equal" in same.stdout


TOY = ("--deterministic", "--global-batch-size", "48", "--micro-batch-size", "8", "--num-samples", "960")
TOY += ("--epochs", "2", "--progress", "none")  # 20 steps per epoch


def _toy(run_dir: Path, nproc: int, *extra: str) -> dict:
    proc = lockstep_cli("train", "toy", "-n", str(nproc), "--run-dir", str(run_dir), *TOY, *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.smoke  # the fast tier's deterministic resize (the test above resizes 4 -> 2 -> 3: make test-all)
def test_a_toy_run_stopped_on_2_ranks_and_resumed_on_1_is_bitwise_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    whole = _toy(tmp_path / "whole", 1)
    resized = tmp_path / "resized"
    _toy(resized, 2, "--max-steps", "25")  # stops mid-epoch 2
    last = _toy(resized, 1)
    assert last["world_size"] == 1 and last["steps"] == whole["steps"] == 40 and last["steps_this_run"] == 15
    assert last["params_sha256"] == whole["params_sha256"]
    assert last["optimizer_sha256"] == whole["optimizer_sha256"]


def test_compare_names_the_first_tensor_that_differs(tmp_path: Path) -> None:
    _train(tmp_path / "a", 1, "--max-steps", "3")
    _train(tmp_path / "b", 1, "--max-steps", "3", "--lr", "0.01")
    different = lockstep_cli("compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert different.returncode == 1, different.stdout + different.stderr
    assert "first difference at model.net.1.bias" in different.stdout, different.stdout
    missing = lockstep_cli("compare", str(tmp_path / "a"), str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "neither a checkpoint" in missing.stderr
