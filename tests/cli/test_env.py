"""`lockstep env`: the bug-report block (versions, backends, devices, threads, launcher, topology)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

import lockstep
from lockstep.launch.envinfo import collect, render
from tests.helpers import child_env, free_port, run_cli


def test_env_command_prints_every_field(tmp_path: Path) -> None:
    result = run_cli("env", cwd=tmp_path, timeout=120, env=child_env(OMP_NUM_THREADS="3"))
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(":", 1) for line in result.stdout.splitlines())
    for name in ("python", "torch", "lockstep", "backends", "devices", "threads", "launcher", "topology"):
        assert name in fields, result.stdout
    assert platform.python_version() in fields["python"]
    assert torch.__version__ in fields["torch"]
    assert lockstep.__version__ in fields["lockstep"]
    assert "gloo=yes" in fields["backends"] and "nccl=" in fields["backends"] and "mpi=" in fields["backends"]
    assert "cuda=" in fields["devices"]
    assert "OMP_NUM_THREADS=3" in fields["threads"] and "torch_num_threads=" in fields["threads"]
    assert fields["launcher"].strip() == "none"
    assert fields["topology"].strip().startswith("rank 0/1")


def test_env_json_under_torchrun_variables(tmp_path: Path) -> None:
    port = str(free_port())  # nothing binds it here; any port the kernel hands out will do
    env = child_env(
        RANK="1",
        WORLD_SIZE="2",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
    )
    result = run_cli("env", "--json", cwd=tmp_path, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["launcher"] == "torchrun"
    assert info["topology"].startswith("rank 1/2 (local 1/2")
    assert info["env"]["MASTER_PORT"] == port
    assert info["backends"]["gloo"] is True


def test_inconsistent_environment_shows_the_error_not_a_crash() -> None:
    info = collect({"RANK": "0"})
    assert info["launcher"] == "torchrun"
    assert info["topology"].startswith("ERROR: partial launcher environment")
    assert "WORLD_SIZE" in info["topology"]
    assert "topology:" in render(info)


def test_slurm_step_is_detected() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_ID": "0",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_JOB_ID": "42",
    }
    info = collect(env)
    assert info["launcher"] == "slurm"
    assert info["topology"].startswith("rank 3/4 (local 1/2, node 1/2) via slurm")
    assert "gpu01" in info["topology"]
    assert info["env"]["SLURM_PROCID"] == "3"
