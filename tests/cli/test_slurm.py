"""`srun python script.py` with lockstep.init(), and `lockstep slurm` end to end, on a real SLURM cluster.

The cluster (munged + slurmctld + slurmd, one node, 2 CPUs) is started once for this module by
testbed/slurm_cluster.py and stopped by PID afterwards; the module is skipped, with the reason, only
where the machine cannot host it (not root, or slurm-wlm and munge not installed: `make testbed`).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.slurm_cluster import SlurmCluster, slurm_cluster, unavailable_reason
from tests.helpers import JOB_TIMEOUT, TINY, child_env, result_line, slurm_cli
from tests.helpers import TINY_STEPS as STEPS

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no SLURM cluster on this machine: {reason}")
    with slurm_cluster(tmp_path_factory.mktemp("slurm") / "cluster") as running:
        yield running


def test_srun_tasks_init_all_reduce_and_match_local_run(
    cluster: SlurmCluster, tmp_path: Path, tiny_reference: dict[str, str]
) -> None:
    """`srun -N1 -n2 python tiny_train.py`: lockstep.init() maps SLURM's variables; gradients all-reduce."""
    out = cluster.run(
        ["srun", "-N1", "-n2", sys.executable, str(TINY), "--steps", STEPS],
        cwd=tmp_path,
        timeout=JOB_TIMEOUT,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr + cluster.logs()
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    port = re.search(r"endpoint \S+:(\d+)", lines[0]).group(1)  # type: ignore[union-attr]
    job = int(port) - 15000  # slurm_port(job id): the port is derived from the job id
    assert 0 < job < 1000
    assert lines == [
        f"rank 0/2 local 0/2 node 0/1 via slurm endpoint {cluster.node}:{port}",
        f"rank 1/2 local 1/2 node 0/1 via slurm endpoint {cluster.node}:{port}",
    ]
    assert result_line(out.stdout) == tiny_reference


def test_slurm_dry_run_prints_and_saves_script(cluster: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('never run')\n")
    out = slurm_cli(
        cluster,
        "--dry-run",
        "--nodes",
        "2",
        "-n",
        "3",
        "--time",
        "30",
        "--requeue",
        "--run-dir",
        "r",
        "train.py",
        "--lr",
        "0.1",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    saved = (tmp_path / "r" / "sbatch.sh").read_text()
    assert out.stdout == saved
    assert "#SBATCH --nodes=2" in saved and "#SBATCH --signal=B:USR1@120" in saved
    assert cluster.run(["squeue", "-h"]).stdout.strip() == ""  # nothing was submitted
    # sbatch itself accepts it (--test-only validates the script and the request without queueing it)
    check = cluster.run(
        ["sbatch", "--test-only", "--nodes=1", str(tmp_path / "r" / "sbatch.sh")], cwd=tmp_path
    )
    assert check.returncode == 0, check.stderr


def test_slurm_job_completes_and_matches_local_run(
    cluster: SlurmCluster, tmp_path: Path, tiny_reference: dict[str, str]
) -> None:
    out = slurm_cli(cluster, "-n", "2", "--run-dir", "r", str(TINY), "--steps", STEPS, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job = int(re.search(r"submitted job (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
    log = tmp_path / "r" / f"slurm-{job}.out"
    assert f"output:    {log}" in out.stdout
    info = cluster.wait(job, timeout=JOB_TIMEOUT)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text
    assert result_line(text) == tiny_reference
    assert f"rendezvous {cluster.node}:{15000 + job % 20000}" in text
    assert (tmp_path / "r" / "logs" / f"{job}.0" / "rank1" / "stdout.log").exists()


def test_slurm_requeue_checkpoints_and_resumes(
    cluster: SlurmCluster, tmp_path: Path, tiny_reference: dict[str, str]
) -> None:
    progress = tmp_path / "progress"
    out = slurm_cli(
        cluster,
        "-n",
        "2",
        "--requeue",
        "--time",
        "10",
        "--run-dir",
        "r",
        str(TINY),
        "--steps",
        STEPS,
        "--sleep",
        "0.3",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--progress",
        str(progress),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    job = int(re.search(r"submitted job (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
    log = tmp_path / "r" / f"slurm-{job}.out"
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= 3):
        assert time.monotonic() < deadline, (
            f"no progress: {cluster.job(job)}\n{log.read_text() if log.exists() else ''}"
        )
        assert cluster.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), (
            log.read_text() if log.exists() else ""
        )
        time.sleep(0.2)
    # What SLURM does --signal-before seconds before the limit (#SBATCH --signal=B:USR1@...): signal the batch shell.
    signalled = cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])
    assert signalled.returncode == 0, signalled.stderr
    # SLURM holds a requeued job for about 2 minutes (Reason=BeginTime); the test lets it start sooner, but
    # not in the same second as the kill: slurmd still holds the job's revoked credential and would refuse
    # to launch it ("Job credential revoked", seen here with StartTime=now).
    cluster.wait(job, {"PENDING"}, restarts=1, timeout=JOB_TIMEOUT)
    released = cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"])
    assert released.returncode == 0, released.stderr
    info = cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, restarts=1, timeout=JOB_TIMEOUT)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text}"
    checkpointed = re.search(r"CHECKPOINTED step=(\d+)", text)
    assert checkpointed, text
    assert "requeueing job" in text and f"job {job} (restart 1)" in text
    result = result_line(text)
    assert 0 < int(result.pop("resumed_from")) == int(checkpointed.group(1)) < int(STEPS)
    assert result == {k: v for k, v in tiny_reference.items() if k != "resumed_from"}


def test_batch_script_without_srun_is_a_world_of_one(cluster: SlurmCluster, tmp_path: Path) -> None:
    """`sbatch -n2` whose script runs python directly (no srun): the batch shell has SLURM_PROCID=0 and
    SLURM_NTASKS=2, yet it is no task of a step; lockstep.init() must not wait for a rank 1 that never comes."""
    script = tmp_path / "job.sh"
    script.write_text(
        f"#!/bin/bash\n{sys.executable} -c 'import lockstep; print(lockstep.init(timeout=20))'\n"
    )
    job = cluster.submit(script, "-n2", f"--output={tmp_path / 'out.txt'}", cwd=tmp_path)
    info = cluster.wait(job, timeout=JOB_TIMEOUT)
    text = (tmp_path / "out.txt").read_text()
    assert info["JobState"] == "COMPLETED", text
    assert "rank 0/1 (local 0/1, node 0/1) via none" in text


def test_cli_dispatches_slurm_help_dry_run_and_errors(tmp_path: Path) -> None:
    """`lockstep slurm` is a command of the CLI (no cluster needed to write a script): --help, --dry-run with
    the script saved and printed, a missing script (exit 2, naming it), and no sbatch on PATH (exit 1)."""
    import subprocess

    def cli(*args: str, **env: str | None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "lockstep", "slurm", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(**env),
        )

    shown = cli("--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: lockstep slurm [options] SCRIPT"), shown
    assert "--requeue" in shown.stdout and "--gpus-per-node" in shown.stdout
    (tmp_path / "train.py").write_text("print('never run')\n")
    dry = cli(
        "--dry-run", "--nodes", "2", "--gpus-per-node", "4", "--run-dir", "r", "train.py", "--lr", "0.1"
    )
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout == (tmp_path / "r" / "sbatch.sh").read_text()
    assert "#SBATCH --nodes=2" in dry.stdout and "#SBATCH --gpus-per-node=4" in dry.stdout
    assert " -n 4 " in dry.stdout and dry.stdout.rstrip().endswith("train.py --lr 0.1")
    assert f"script saved as {tmp_path / 'r' / 'sbatch.sh'}" in dry.stderr
    missing = cli("--dry-run", "absent.py")
    assert missing.returncode == 2 and "lockstep slurm: error: script 'absent.py' not found" in missing.stderr
    no_sbatch = cli("--run-dir", "s", "train.py", PATH=os.path.dirname(sys.executable))
    assert no_sbatch.returncode == 1 and "sbatch was not found on PATH" in no_sbatch.stderr, no_sbatch.stderr
