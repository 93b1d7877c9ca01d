"""`lockstep run` when things go wrong: a crashing rank's summary, and Ctrl-C/SIGTERM leaving no process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import RUN_TIMEOUT, alive, child_env, lockstep_cmd, run_cli, write

CRASH = """
import sys, time
import lockstep

topo = lockstep.init()
print(f"rank {topo.rank} is up", flush=True)

def fail_here(how):
    if how == "raise":
        raise ValueError(f"boom-rank-{topo.rank}")
    sys.exit(7)

if topo.rank == 1:
    print("rank 1 is about to fail", file=sys.stderr, flush=True)
    fail_here(sys.argv[1])
lockstep.barrier()
time.sleep(600)  # rank 0 would wait forever: the launcher must stop it
"""


@pytest.mark.smoke  # the fast tier's failure summary
def test_crashing_rank_gives_one_summary_and_stops_the_others(tmp_path: Path) -> None:
    """(How soon the summary comes is a claim of benchmarks/failure_latency.py, case crash.)"""
    write(tmp_path / "crash.py", CRASH)
    result = run_cli("run", "-n", "2", "--run-dir", "out", "crash.py", "raise", cwd=tmp_path)
    err = result.stderr
    assert result.returncode == 1, err
    assert err.count("lockstep run: FAILED") == 1
    summary = err[err.index("lockstep run: FAILED") :]
    assert "FAILED: rank 1/2" in summary and "exited with code 1" in summary
    assert 'in fail_here\n    raise ValueError(f"boom-rank-{topo.rank}")\nValueError: boom-rank-1' in summary
    assert (
        "lockstep/launch/worker.py" not in summary and "<frozen runpy>" not in summary
    )  # only the user's frames
    assert "rank 1 is about to fail" in summary  # the log tail
    assert str(tmp_path / "out" / "rank1" / "stderr.log") in summary
    assert "<N/A>" not in err
    # The other rank's traceback is folded on the console to one line; rank 0 is reported as stopped.
    assert "also: rank 0" in summary


def test_sys_exit_code_is_reported_and_returned(tmp_path: Path) -> None:
    write(tmp_path / "crash.py", CRASH)
    result = run_cli("run", "-n", "2", "--run-dir", "out", "crash.py", "exit", cwd=tmp_path)
    assert result.returncode == 7, result.stderr
    summary = result.stderr[result.stderr.index("lockstep run: FAILED") :]
    assert "FAILED: rank 1/2" in summary and "exited with code 7" in summary
    assert "in fail_here\n    sys.exit(7)\nSystemExit: 7" in summary


DATALOADER = """
import os, signal, subprocess, sys, time
import torch
import lockstep
from torch.utils.data import DataLoader, Dataset

out = sys.argv[1]

class Endless(Dataset):
    def __len__(self):
        return 10**9
    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.tensor([float(i)])

def note_pid(worker_id):
    if "stubborn" in sys.argv:  # a worker that ignores polite signals: only SIGKILL stops it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    open(os.path.join(out, f"pid-loader-{os.getpid()}"), "w").close()

topo = lockstep.init()
open(os.path.join(out, f"pid-rank{topo.rank}-{os.getpid()}"), "w").close()
if "stubborn" in sys.argv:  # a child that ignores polite signals and does not watch its parent
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", code])
    open(os.path.join(out, f"pid-child{topo.rank}-{child.pid}"), "w").close()
loader = DataLoader(Endless(), batch_size=2, num_workers=2, worker_init_fn=note_pid)
for step, batch in enumerate(loader):
    if step == 3:
        open(os.path.join(out, f"ready-{topo.rank}"), "w").close()
"""


@pytest.mark.parametrize(("sig", "stubborn"), [(signal.SIGINT, False), (signal.SIGTERM, True)])
def test_signal_to_launcher_leaves_no_process(tmp_path: Path, sig: signal.Signals, stubborn: bool) -> None:
    write(tmp_path / "loader.py", DATALOADER)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    args = [
        "run",
        "-n",
        "2",
        "--run-dir",
        "out",
        "loader.py",
        str(pids_dir),
        *(["stubborn"] if stubborn else []),
    ]
    launcher = subprocess.Popen(
        lockstep_cmd(*args),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not all((pids_dir / f"ready-{r}").exists() for r in (0, 1)):
            assert launcher.poll() is None, launcher.communicate()[1]
            assert time.monotonic() < deadline, "workers never became ready"
            time.sleep(0.2)
        pids = [int(p.name.rsplit("-", 1)[1]) for p in pids_dir.glob("pid-*")]
        # 2 ranks x (itself + 2 loader workers [+ 1 stubborn child])
        assert len(pids) == (8 if stubborn else 6), sorted(p.name for p in pids_dir.iterdir())
        assert all(alive(pid) for pid in pids)
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + sig, stderr
    assert f"interrupted by {sig.name}" in stderr
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes left behind after {sig.name}: {survivors}"


SIGNALLED = """
import os, signal, sys, time

out, rank = sys.argv[1], os.environ["RANK"]

def note(signum, frame):
    open(os.path.join(out, f"{signal.Signals(signum).name}-rank{rank}"), "w").close()
    if signum == signal.SIGTERM:  # a graceful stop: the script saves what it must, then exits
        sys.exit(0)

for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
    signal.signal(sig, note)
open(os.path.join(out, f"ready-rank{rank}"), "w").close()
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("usr1_ignored", [False, True], ids=["plain", "started-with-usr1-ignored"])
def test_usr1_usr2_reach_every_worker_and_sigterm_stops_them_gracefully(
    tmp_path: Path, usr1_ignored: bool
) -> None:
    """SIGUSR1/SIGUSR2 to `lockstep run` reach both ranks and the run goes on; SIGTERM reaches both ranks'
    handlers (which exit 0) and the launcher exits 143. A launcher started with SIGUSR1 ignored (`lockstep
    slurm`'s `trap '' USR1`: srun signals the workers itself) does not pass it on."""
    write(tmp_path / "signalled.py", SIGNALLED)
    out = tmp_path / "seen"
    out.mkdir()
    command = lockstep_cmd("run", "-n", "2", "--run-dir", "run", "signalled.py", str(out))
    if usr1_ignored:
        command = ["bash", "-c", 'trap "" USR1; exec "$@"', "bash", *command]
    launcher = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()
    )

    def wait_for(*names: str) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not all((out / name).exists() for name in names):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, f"never saw {names}: {sorted(p.name for p in out.iterdir())}"
            time.sleep(0.05)

    try:
        wait_for("ready-rank0", "ready-rank1")
        if usr1_ignored:
            # SIGUSR2 right after it is the marker that makes the check need no waiting: Python runs pending
            # handlers in signal-number order (USR1 = 10 before USR2 = 12), in the launcher and in each
            # worker, so a launcher that passed SIGUSR1 on would have done so before SIGUSR2, and a worker
            # that got both writes SIGUSR1-rank* before SIGUSR2-rank*.
            launcher.send_signal(signal.SIGUSR1)
        launcher.send_signal(signal.SIGUSR2)
        wait_for("SIGUSR2-rank0", "SIGUSR2-rank1")
        if usr1_ignored:
            assert not list(out.glob("SIGUSR1-*")), sorted(p.name for p in out.iterdir())
        else:
            launcher.send_signal(signal.SIGUSR1)
            wait_for("SIGUSR1-rank0", "SIGUSR1-rank1")
        assert launcher.poll() is None  # the run goes on
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert (out / "SIGTERM-rank0").exists() and (out / "SIGTERM-rank1").exists()
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM" in stderr and "FAILED" not in stderr
