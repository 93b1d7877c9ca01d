"""lockstep.fit with checkpoint_async=True: every checkpoint holds the bits a blocking save of the same step
holds, the run ends with its last write complete, summary.json says what saves cost (checkpoint_stall_s,
checkpoints_written), and a run stopped after an asynchronous save resumes from it bitwise. Checked in the
default mode (with a sharded optimizer: its state consolidated on rank 0 before the copy), in deterministic
mode and with a periodic sync (every rank's state in the checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import lockstep
from lockstep.checkpoint import compare_checkpoints
from lockstep.jobs import catalog
from lockstep.testing import run_distributed

TIMEOUT = 300
MODES: dict[str, dict[str, Any]] = {
    "sharded": {"num_samples": 192, "batch_size": 8, "shard_optimizer": True, "clip_grad_norm": 1.0},
    "deterministic": {
        "num_samples": 192,
        "global_batch_size": 24,
        "micro_batch_size": 4,
        "deterministic": True,
    },
    "diloco": {"num_samples": 192, "batch_size": 8, "sync": "diloco", "sync_every": 3},
}


def _train(run_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    config = catalog.ToyConfig(run_dir=run_dir, progress="none", epochs=2, checkpoint_every=4, **settings)
    built = catalog.build("toy", config)
    return lockstep.fit(built.model, built.train_data, loss_fn=built.loss_fn, config=config).summary


def _steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_background_checkpoints_hold_the_blocking_bits_and_resume_exactly(tmp_path: Path, mode: str) -> None:
    settings = {**MODES[mode], "keep_checkpoints": 10}
    blocking = run_distributed(_train, 2, args=(str(tmp_path / "blocking"), settings), timeout=TIMEOUT)[0]
    background_settings = {**settings, "checkpoint_async": True}
    background = run_distributed(
        _train, 2, args=(str(tmp_path / "async"), background_settings), timeout=TIMEOUT
    )
    zero = background[0]
    assert zero["params_sha256"] == blocking["params_sha256"]
    assert zero["optimizer_sha256"] == blocking["optimizer_sha256"]
    saved = _steps(tmp_path / "blocking")
    assert saved == _steps(tmp_path / "async") and len(saved) >= 3
    for name in saved:
        verdict = compare_checkpoints(
            tmp_path / "blocking/checkpoints" / name, tmp_path / "async/checkpoints" / name
        )
        assert verdict.equal, f"{name}: {verdict.describe()}"
    assert zero["checkpoints_written"] == blocking["checkpoints_written"] == len(saved)
    assert zero["checkpoint_stall_s"] > 0 and blocking["checkpoint_stall_s"] > 0
    assert zero["checkpoint_cpu_copy_bytes"] > 0 and blocking["checkpoint_cpu_copy_bytes"] == 0  # the copy
    assert isinstance(zero["stragglers"], list)  # rank 0's straggler reports (runtime/straggler_reports.py)
    # Stopped after an asynchronous save (max_steps), then resumed: the uninterrupted run's bits.
    stopped = {**background_settings, "max_steps": 9}
    run_distributed(_train, 2, args=(str(tmp_path / "resumed"), stopped), timeout=TIMEOUT)
    resumed = run_distributed(
        _train, 2, args=(str(tmp_path / "resumed"), background_settings), timeout=TIMEOUT
    )[0]
    assert resumed["params_sha256"] == blocking["params_sha256"]
    assert resumed["optimizer_sha256"] == blocking["optimizer_sha256"]
