"""The live launcher's account end to end (`lockstep run --min-world`, launch/live_account.py): a worker
that raises ends the job (or restarts it whole while --max-restarts allows), a replacement never admitted
is no finisher, an interrupt is not a fault, and a relayed traceback carries one rank prefix.

Real processes on real gloo; tests/cli/launcher_program.py says what each rank does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import child_env, run_cli

PROGRAM = Path(__file__).with_name("launcher_program.py")
STEPS = 16  # 2 epochs of 8 steps


def _run(out: Path, *launch: str, events: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    return run_cli(
        "run", *launch, "--run-dir", str(out / "logs"), str(PROGRAM), str(out), *events,
        cwd=out.parent, timeout=180,
    )  # fmt: skip


@pytest.mark.smoke  # the fast tier's live-mode account
def test_a_rank_that_raises_ends_the_live_job_without_a_replacement(tmp_path: Path) -> None:
    """Before, a member that raised was replaced like a lost one and the job could end "finished", exit 0."""
    out = tmp_path / "raise"
    result = _run(out, "-n", "2", "--min-world", "1", events=("raise:1:3",))
    err = result.stderr
    assert result.returncode == 1, err
    assert err.count("lockstep run: FAILED") == 1, err
    summary = err[err.index("lockstep run: FAILED") :]
    assert "FAILED: rank 1/2" in summary and "ValueError: boom on launch rank 1 at step 3" in summary
    assert "also: rank 0" in summary and "(stopped by the launcher)" in summary
    assert "finished on" not in err and "ranks go on" not in err and "replacement rank" not in err, err
    assert not (out / "done-0").exists() and not (out / "logs" / "rank2").exists()


@pytest.mark.parametrize("loop", ["fit", "loop"])
@pytest.mark.parametrize("raisers", [(1,), (0, 1, 2)], ids=["one rank", "every rank"])
def test_a_runtime_error_of_the_programs_own_ends_the_live_job_at_once_named_once(
    tmp_path: Path, loop: str, raisers: tuple[int, ...]
) -> None:
    """gloo reports a dead peer as a RuntimeError: before, a program's own RuntimeError started a recovery
    like one (release the replica, re-form), and the others met a closed connection. Now it ends the job at
    once on every rank, with fit and with LiveLoop: no recovery, no "go on" line, no transport error."""
    out = tmp_path / "raise"
    events = tuple(f"raise_runtime:{r}:3" for r in raisers) + ((loop,) if loop == "loop" else ())
    result = _run(out, "-n", "3", "--min-world", "1", events=events)
    err = result.stderr
    assert result.returncode == 1, err
    assert err.count("lockstep run: FAILED") == 1, err
    summary = err[err.index("lockstep run: FAILED") :]
    named = [r for r in raisers if f"RuntimeError: boom on launch rank {r} at step 3" in summary]
    assert named == list(raisers), summary
    for quiet in (
        "ranks go on",
        "replacement rank",
        "finished on",
        "Connection",
        "gloo",
        "MembershipChanged",
    ):
        assert quiet not in err, err
    for rank in set(range(3)) - set(raisers):
        assert f"rank {rank} was killed by SIGTERM (exit code -15) (stopped by the launcher)" in summary
        assert "Traceback" not in (out / "logs" / f"rank{rank}" / "stderr.log").read_text()
    assert not list(out.glob("done-*")) and not (out / "logs" / "rank3").exists()


def test_with_a_restart_left_the_whole_job_restarts_from_its_last_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "restart"
    result = _run(out, "-n", "2", "--min-world", "1", "--max-restarts", "1", events=("raise:1:5",))
    err = result.stderr
    assert result.returncode == 0, err
    assert err.count("restart 1 of the whole job") == 1, err
    assert "rank 1 raised ValueError: boom on launch rank 1 at step 5" in err
    assert "all 2 ranks from the last checkpoint (0 of --max-restarts 1 left)" in err
    assert "finished on 2 of 2 ranks, after 1 restart of the whole job" in err, err
    assert "ranks go on" not in err and "FAILED" not in err, err
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert 0 < summary["steps_this_run"] < STEPS  # resumed from the checkpoint the first attempt saved
    assert summary["restarts"] == 1
    assert (out / "logs" / "restart1" / "rank1" / "stderr.log").exists()
    assert (out / "done-0").exists() and (out / "done-1").exists()


def test_a_replacement_never_admitted_is_not_counted_as_a_finisher(tmp_path: Path) -> None:
    out = tmp_path / "late"
    result = _run(out, "-n", "2", "--min-world", "1", "--max-restarts", "1", events=("kill:1:3", "late"))
    err = result.stderr
    assert result.returncode == 0, err
    assert "rank 1 killed by SIGKILL; 1 of 2 ranks go on (--min-world 1); replacement rank 2 started" in err
    assert "lockstep run: finished on 1 of 2 ranks, without a restart; lost rank 1 (killed by SIGKILL)" in err
    assert "replacements: ranks" not in err, err
    assert "replacement 2 was not needed" in (out / "logs" / "rank2" / "stderr.log").read_text()


def test_sigterm_to_the_launcher_stops_the_workers_without_reporting_faults(tmp_path: Path) -> None:
    out = tmp_path / "term"
    out.mkdir()
    log = tmp_path / "launcher.log"
    cmd = [sys.executable, "-m", "lockstep", "run", "-n", "2", "--min-world", "1", "--max-restarts", "2"]
    cmd += ["--run-dir", str(out / "logs"), str(PROGRAM), str(out)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=child_env(), cwd=tmp_path, stdout=fh, stderr=fh)
        try:
            deadline = time.monotonic() + 120
            while not list((out / "run").glob("checkpoints/step_*")) and time.monotonic() < deadline:
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text
    assert "lockstep run: interrupted by SIGTERM; every worker was stopped" in text
    assert "ranks go on" not in text and "replacement rank" not in text and "killed by SIGTERM" not in text
    for uid in (0, 1):
        pid = int((out / f"pid-{uid}").read_text())
        assert (
            not os.path.exists(f"/proc/{pid}")
            or open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"
        )


def test_a_traceback_carries_one_rank_prefix_after_two_re_formations(tmp_path: Path) -> None:
    """Each init_process_group wrapped sys.excepthook in another `[rankN]: ` prefix (torch's): after two
    re-formations rank 0's traceback read `[rank0]: [rank0]: [rank0]: Traceback ...`."""
    out = tmp_path / "prefix"
    result = _run(out, "-n", "3", "--min-world", "1", events=("kill:2:2", "kill:1:4", "raise:0:6"))
    err = result.stderr
    assert result.returncode == 1, err
    assert "rank 2 killed by SIGKILL; 2 of 3 ranks go on" in err and "rank 1 killed by SIGKILL; 1 of 3" in err
    log = (out / "logs" / "rank0" / "stderr.log").read_text()
    assert "[rank0]: Traceback (most recent call last):" in log, log
    assert "[rank0]: ValueError: boom on launch rank 0 at step 6" in log, log
    assert "]: [rank" not in log and "]: [rank" not in err, log
