"""Every tutorial program in examples/ runs on CPU under `lockstep run -n 2` with no arguments."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = child_env()
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def _lockstep_run(script: str, *args: str, cwd: Path, logs: str = "all") -> subprocess.CompletedProcess[str]:
    return _run(
        [
            sys.executable,
            "-m",
            "lockstep",
            "run",
            "-n",
            "2",
            "--logs",
            logs,
            str(ROOT / "examples" / script),
            *args,
        ],
        cwd,
    )


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("ddp_basic.py", "rank 1: step done"),
        ("ddp_checkpoint.py", "rank 1: checkpoint saved, loaded and trained from"),
        ("ddp_model_parallel.py", "rank 1: model-parallel step done on cpu and cpu"),
        ("elastic_ddp.py", "Finished running basic DDP example on rank 1."),
    ],
)
def test_tutorial_program_runs_on_two_ranks(script: str, expected: str, tmp_path: Path) -> None:
    proc = _lockstep_run(script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert expected in proc.stdout + proc.stderr


def test_basic_example_keeps_replicas_identical(tmp_path: Path) -> None:
    proc = _lockstep_run("ddp_basic.py", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    sums = {line.split("checksum")[-1].strip() for line in out.splitlines() if "parameter checksum" in line}
    assert proc.returncode == 0 and len(sums) == 1, out


def test_elastic_example_runs_under_torchrun_too(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    proc = _run(
        [torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "elastic_ddp.py")],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Finished running basic DDP example on rank 1." in proc.stdout


def test_mnist_example_learns(tmp_path: Path) -> None:
    proc = _lockstep_run("mnist_ddp.py", "--epochs", "2", "--max-train", "4000", cwd=tmp_path, logs="rank0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    accuracy = float(proc.stdout.split("test accuracy")[-1].split()[0])
    assert accuracy > 0.6, proc.stdout


def test_multigpu_trainer_snapshots_and_resumes(tmp_path: Path) -> None:
    first = _lockstep_run(
        "multigpu_trainer.py", "4", "2", "--snapshot", "snap.pt", cwd=tmp_path, logs="rank0"
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Epoch 4 | Training snapshot saved" in first.stdout
    second = _lockstep_run(
        "multigpu_trainer.py", "6", "2", "--snapshot", "snap.pt", cwd=tmp_path, logs="rank0"
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Resuming training from snapshot at Epoch 4" in second.stdout
    assert "Epoch 6 | Training snapshot saved" in second.stdout


@pytest.mark.slow
def test_multigpu_trainer_default_arguments(tmp_path: Path) -> None:
    proc = _lockstep_run("multigpu_trainer.py", cwd=tmp_path, logs="rank0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Epoch 50 | Training snapshot saved" in proc.stdout
