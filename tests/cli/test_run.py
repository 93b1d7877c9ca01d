"""`lockstep run` end to end: ranks, argv pass-through, threads, logs, console relay, concurrency, -m."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import RUN_TIMEOUT, child_env, lockstep_cmd, run_cli, write

REPORT = """
import os, sys, warnings
import lockstep

topo = lockstep.init()
print(f"REPORT rank={topo.rank} world={topo.world_size} launcher={topo.launcher} "
      f"threads={os.environ.get('OMP_NUM_THREADS')} argv={sys.argv[1:]!r}", flush=True)
if topo.rank == 1:
    print("rank one says hello on stdout")
    warnings.warn("rank one is worried")
    print("ERROR: rank one printed an error line")
lockstep.barrier()
lockstep.shutdown()
"""


@pytest.mark.smoke  # the fast tier's `lockstep run`
def test_two_ranks_args_threads_logs_and_relay(tmp_path: Path) -> None:
    script = write(tmp_path / "report.py", REPORT)
    result = run_cli(
        "run",
        "-n",
        "2",
        "--run-dir",
        "out",
        script.name,
        "--lr",
        "3",
        "-n",
        "5",
        cwd=tmp_path,
        env=child_env(OMP_NUM_THREADS=None),
    )
    assert result.returncode == 0, result.stderr
    # First line: what was resolved.
    first = result.stderr.splitlines()[0]
    assert re.match(
        r"lockstep run: 2 processes x 1 node \(world 2\), backend gloo, endpoint \S+:\d+, "
        r"OMP_NUM_THREADS=\d+ \(\d+ cores / 2 processes\), DDP engine torch, logs in .*out",
        first,
    ), first
    # Rank 0 streams to the console; rank 1's stdout does not, its warnings and errors do, prefixed.
    assert "REPORT rank=0 world=2 launcher=torchrun" in result.stdout
    assert "rank=1" not in result.stdout + result.stderr
    assert "rank one says hello" not in result.stdout + result.stderr
    assert re.search(r"^\[rank 1\] .*UserWarning: rank one is worried", result.stderr, re.M)
    assert "[rank 1] ERROR: rank one printed an error line" in result.stderr
    # Per-rank log files hold everything.
    out = tmp_path / "out"
    rank1 = (out / "rank1" / "stdout.log").read_text()
    assert "REPORT rank=1 world=2" in rank1 and "rank one says hello" in rank1
    assert "rank one is worried" in (out / "rank1" / "stderr.log").read_text()
    assert "REPORT rank=0 world=2" in (out / "rank0" / "stdout.log").read_text()
    # The script's argv is untouched (no --local-rank, its own -n kept); threads = cores // processes.
    for rank in (0, 1):
        line = (out / f"rank{rank}" / "stdout.log").read_text().splitlines()[0]
        assert line.endswith("argv=['--lr', '3', '-n', '5']"), line
        threads = int(re.search(r"threads=(\d+)", line).group(1))
        cores = int(re.search(r"\((\d+) cores", first).group(1))
        assert threads == max(1, cores // 2)


def test_plain_python_is_a_world_of_one(tmp_path: Path) -> None:
    script = write(tmp_path / "report.py", REPORT)
    result = subprocess.run(
        [sys.executable, script.name, "--x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=child_env(),
    )
    assert result.returncode == 0, result.stderr
    assert "REPORT rank=0 world=1 launcher=none threads=1 argv=['--x']" in result.stdout


def test_logs_all_and_module_mode(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    write(pkg / "__init__.py", "")
    write(pkg / "train.py", REPORT)
    result = run_cli(
        "run",
        "-n",
        "2",
        "--logs",
        "all",
        "--run-dir",
        "out",
        "-m",
        "mypkg.train",
        "--epochs",
        "1",
        cwd=tmp_path,
        env=child_env(OMP_NUM_THREADS="2"),
    )
    assert result.returncode == 0, result.stderr
    assert "OMP_NUM_THREADS=2 (set by you)" in result.stderr.splitlines()[0]
    for rank in (0, 1):
        assert (
            f"[rank {rank}] REPORT rank={rank} world=2 launcher=torchrun threads=2 argv=['--epochs', '1']"
            in result.stdout
        )
    assert "[rank 1] rank one says hello on stdout" in result.stdout


def test_two_runs_at_once_do_not_collide(tmp_path: Path) -> None:
    script = write(tmp_path / "report.py", REPORT)
    procs = [
        subprocess.Popen(
            lockstep_cmd("run", "-n", "2", "--run-dir", f"out{i}", script.name, f"job{i}"),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=RUN_TIMEOUT))
    finally:
        for proc in procs:
            proc.kill()
    endpoints = []
    for i, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, stderr
        assert f"REPORT rank=0 world=2 launcher=torchrun threads=1 argv=['job{i}']" in stdout
        assert f"argv=['job{i}']" in (tmp_path / f"out{i}" / "rank1" / "stdout.log").read_text()
        endpoints.append(re.search(r"endpoint (\S+),", stderr).group(1))
    assert endpoints[0] != endpoints[1]


def test_default_run_dir_is_created_and_printed(tmp_path: Path) -> None:
    write(tmp_path / "hello.py", "print('hello')\n")  # no torch in the worker: fast
    result = run_cli("run", "hello.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run_dir = Path(re.search(r"logs in (\S+)", result.stderr).group(1))
    assert run_dir.parent == tmp_path / "runs"
    assert (run_dir / "rank0" / "stdout.log").read_text() == "hello\n"
    assert result.stdout == "hello\n"


def test_bad_input_exits_2_naming_the_fix(tmp_path: Path) -> None:
    write(tmp_path / "ok.py", "print('never')\n")
    cases = {
        ("run", "-n", "2", "missing.py"): "script 'missing.py' not found",
        ("run", "-n", "0", "ok.py"): "-n/--nproc-per-node must be an integer >= 1, got 0",
        ("run", "--rdzv-endpoint", "host:port", "ok.py"): "is not a TCP port",
        ("run", "--nnodes", "2", "ok.py"): "needs --rdzv-endpoint HOST:PORT",
        ("run", "-m", "no_such_pkg_xyz.train"): "module 'no_such_pkg_xyz.train' (-m) was not found",
        ("nosuchcommand",): "unknown command 'nosuchcommand'",
    }
    for argv, needle in cases.items():
        result = run_cli(*argv, cwd=tmp_path, timeout=60)
        assert result.returncode == 2, (argv, result.stderr)
        assert needle in result.stderr, (argv, result.stderr)
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "runs").exists()


def test_port_in_use_for_a_multi_node_endpoint(tmp_path: Path) -> None:
    import socket

    write(tmp_path / "ok.py", "print('never')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "ok.py",
            cwd=tmp_path,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert f"port {port} is already in use" in result.stderr and "pick another port" in result.stderr


def test_help_and_version() -> None:
    result = subprocess.run(lockstep_cmd("run", "--help"), capture_output=True, text=True, timeout=60)
    assert (
        result.returncode == 0 and "--nproc-per-node" in result.stdout and "--rdzv-endpoint" in result.stdout
    )
    result = subprocess.run(lockstep_cmd("--help"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and all(cmd in result.stdout for cmd in ("run", "env", "train"))


def test_no_backend_threads_outlive_shutdown(tmp_path: Path) -> None:
    """An optimizer built after init (torch imports modules lazily then) must not pin the group past shutdown.

    Pinned, gloo's threads live into interpreter teardown and a worker can abort as it exits.
    """
    script = write(
        tmp_path / "threads.py",
        """
        import os
        import torch
        import lockstep

        lockstep.init()
        model = lockstep.DistributedDataParallel(torch.nn.Linear(4, 2))
        torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(3, 4)).sum().backward()
        lockstep.shutdown()
        names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
        print("threads after shutdown:", [n for n in names if "gloo" in n])
    """,
    )
    proc = run_cli("run", "-n", "2", "--logs", "all", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("threads after shutdown: []") == 2, proc.stdout
