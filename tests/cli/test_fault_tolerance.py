"""Fault tolerance end to end: SIGKILL a rank under `lockstep run --max-restarts`, the job resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
HOLD_AT = 11  # the forward (= training step, 1-based) in which rank 1 holds in the first attempt
LAST_CHECKPOINT = 8  # checkpoint_every=4: the newest checkpoint before step 11

TRAIN_SCRIPT = '''
import os, sys, threading, torch
from torch import nn
from torch.utils.data import TensorDataset
import lockstep
from lockstep.trainer.settings.config import FitConfig

class HeldToy(nn.Module):
    """The tutorial's ToyModel; in the first attempt, rank 1 stops in its HOLD_AT-th forward, says so in a
    file and waits there to be killed: the kill lands at a known step, with no timing involved."""
    def __init__(self):
        super().__init__()
        self.net1, self.net2 = nn.Linear(10, 10), nn.Linear(10, 5)
        self.calls = 0
    def forward(self, x):
        self.calls += 1
        first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        if first_attempt and topo.rank == 1 and self.calls == int(os.environ.get("HOLD_AT", "0")):
            open(os.path.join(run_dir, "holding"), "w").close()
            threading.Event().wait()  # until SIGKILL
        return self.net2(torch.relu(self.net1(x)))

topo = lockstep.init()
run_dir = sys.argv[1]
os.makedirs(run_dir, exist_ok=True)
with open(os.path.join(run_dir, f"pid.{topo.rank}"), "w") as f:
    f.write(str(os.getpid()))
gen = torch.Generator().manual_seed(1)
x = torch.randn(128, 10, generator=gen)
data = TensorDataset(x, x @ torch.randn(10, 5, generator=gen))
torch.manual_seed(0)
model = HeldToy()
config = FitConfig(run_dir=run_dir, batch_size=4, epochs=2, optimizer="sgd", momentum=0.0, lr=0.05,
                   task="regression", checkpoint_every=4, log_every=4, progress="lines")
lockstep.fit(model, data, loss_fn=nn.functional.mse_loss, config=config)
if topo.is_main:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.save(flat, os.path.join(run_dir, "final_params.pt"))
lockstep.shutdown()
'''


def _launch(script: Path, run_dir: Path, hold_at: int, restarts: int) -> subprocess.Popen[str]:
    env = child_env(HOLD_AT=str(hold_at))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lockstep",
            "run",
            "-n",
            "2",
            "--max-restarts",
            str(restarts),
            str(script),
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_killed_rank_restarts_and_finishes_bitwise_identical(tmp_path: Path) -> None:
    import torch

    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    reference = _launch(script, tmp_path / "reference", 0, 0)
    out, _ = reference.communicate(timeout=180)
    assert reference.returncode == 0, out

    victim_run = tmp_path / "victim"
    # 16 steps per epoch, checkpoints after steps 4 and 8: rank 1 holds in step 11, the run resumes from 8
    proc = _launch(script, victim_run, HOLD_AT, 2)
    try:
        deadline = time.monotonic() + 120
        while not (victim_run / "holding").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "rank 1 never reached the step where it holds"
            time.sleep(0.1)  # polling pace only
        saved = sorted(int(p.name.split("_")[1]) for p in (victim_run / "checkpoints").glob("step_*"))
        assert saved[-1:] == [LAST_CHECKPOINT], saved
        os.kill(int((victim_run / "pid.1").read_text()), signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert f"resumed from step {LAST_CHECKPOINT} " in out
    # The restart's cost in the run's account: steps 9 and 10 had counted (rank 0 stood in step 11) and were
    # undone, their 2 x 8 samples lost; the time from the checkpoint to the resumed first step is the restart's.
    summary = json.loads((victim_run / "summary.json").read_text())
    assert summary["samples_lost"] == (HOLD_AT - 1 - LAST_CHECKPOINT) * 8, summary
    assert summary["lost_s_by_cause"]["restart"] > 0 and summary["goodput"] < 1, summary
    last = out.rstrip().splitlines()[-1]  # the launcher's last line: the same account, rank 0's
    assert last.startswith(f"lockstep run: goodput {summary['goodput']:.3f} (lost "), last
    assert " s restart" in last and last.endswith(", 16 samples lost"), last
    wall = summary["goodput_wall_s"]
    assert abs(summary["training_s"] + sum(summary["lost_s_by_cause"].values()) - wall) < 0.01, summary
    final = torch.load(victim_run / "final_params.pt", weights_only=True)
    expected = torch.load(tmp_path / "reference" / "final_params.pt", weights_only=True)
    assert torch.equal(final, expected)


RESTART_SCRIPT = """
import os, torch, torch.distributed as dist, lockstep
topo = lockstep.init()
t = torch.ones(1) * (topo.rank + 1)
dist.all_reduce(t)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "0" and topo.rank == 1:
    os._exit(3)
dist.barrier()
print(f"rank {topo.rank} done in attempt {attempt} with sum {t.item()}", flush=True)
"""


def test_max_restarts_restarts_every_worker_on_a_fresh_rendezvous(tmp_path: Path) -> None:
    # A restarted worker must not read the previous attempt's addresses from the agent's store.
    script = tmp_path / "restart.py"
    script.write_text(RESTART_SCRIPT)
    env = child_env()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lockstep",
            "run",
            "-n",
            "2",
            "--max-restarts",
            "2",
            "--logs",
            "all",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "restart 1/2" in proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank {rank} done in attempt 1 with sum 3.0" in proc.stdout
