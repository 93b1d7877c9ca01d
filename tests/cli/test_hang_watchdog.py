"""The hang watchdog end to end: a rank that stalls, stops, dies or desyncs ends the job within seconds
with one report naming it (console and hang_report.json), and no process is left; healthy slow runs pass.

Each case runs tests/cli/hang_program.py on 2 gloo ranks with a 4 s hang timeout (10 s for the
straggler). The report must name the culprit rank, what the others wait in (op and sequence number),
and the culprit's phase or a frame of the function it is stuck in, and never come before the timeout.
How soon after it the report comes, and the job ends, is a claim of benchmarks/failure_latency.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import alive, child_env, free_port, run_cli

PROGRAM = Path(__file__).with_name("hang_program.py")
TIMEOUT = 4.0
STALL_EXIT_CODE = 124


def _run(tmp_path: Path, case: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return run_cli(
        "run",
        "-n",
        "2",
        "--hang-timeout",
        f"{timeout:g}",
        "--run-dir",
        "out",
        str(PROGRAM),
        case,
        str(tmp_path),
        cwd=tmp_path,
        timeout=90,
    )


def _report(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "out" / "hang_report.json").read_text())


def _pids(tmp_path: Path) -> list[int]:
    return [int(p.name.split("-")[2]) for p in tmp_path.glob("pid-*")]


def _assert_no_process_left(tmp_path: Path) -> None:
    pids = _pids(tmp_path)
    assert len(pids) == 2, pids
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "a rank outlived the job"


def _check_failed_job(
    tmp_path: Path,
    result: subprocess.CompletedProcess[str],
    culprits: list[list[int]] | None = None,
) -> dict[str, Any]:
    err = result.stderr
    assert result.returncode != 0, err
    assert "lockstep: HANG DETECTED" in err and "the hang watchdog ended the job" in err, err
    assert err.count("lockstep: HANG DETECTED") == 1, err  # one report, printed by the launcher
    report = _report(tmp_path)
    # A desync has no single culprit: whichever rank judges first names the other.
    assert report["culprits"] in (culprits or [[1]]), report
    assert report["summary"] in err
    _assert_no_process_left(tmp_path)
    return report


def _waiter(report: dict[str, Any]) -> dict[str, Any]:
    rank0 = report["ranks"]["0"]
    assert rank0["waiting"] is not None, rank0
    return rank0


@pytest.mark.parametrize(
    ("case", "frame"),
    [
        pytest.param("user_sleep", "in stuck_in_user_code", marks=pytest.mark.smoke),  # the fast tier's hang
        ("deadlock", "in deadlocked"),
        ("busy_loop", "in spin_forever"),
    ],
)
def test_rank_stuck_in_user_code_is_named_with_its_stack(tmp_path: Path, case: str, frame: str) -> None:
    result = _run(tmp_path, case)
    report = _check_failed_job(tmp_path, result)
    assert report["kind"] == "stall"
    waiter = _waiter(report)
    assert waiter["waiting"]["op"].startswith("allreduce") and waiter["waiting"]["seq"] > 0
    assert TIMEOUT <= waiter["waiting_for"], waiter["waiting_for"]  # not before the timeout
    culprit = report["ranks"]["1"]
    assert culprit["waiting"] is None and culprit["phase"] == "between steps" and culprit["step"] == 4
    assert any(frame in f for f in culprit["stack"]), culprit["stack"]
    threads = culprit["threads"]  # every thread of the stuck rank, the watchdog's own included
    assert any("lockstep-watchdog" in name for name in threads) and len(threads) >= 2
    assert "rank 1 busy in phase 'between steps'" in result.stderr
    assert frame in result.stderr  # the console report shows the stuck frame


def test_wait_in_a_collective_of_the_users_own_is_seen_in_the_stack(tmp_path: Path) -> None:
    """dist.all_reduce called by the program itself: no sequence number, but the watchdog sees the main
    thread inside torch.distributed and the site that called it."""
    result = _run(tmp_path, "untracked")
    report = _check_failed_job(tmp_path, result)
    waiter = report["ranks"]["0"]
    assert waiter["waiting"] is None, waiter
    assert waiter["untracked"].startswith("torch.distributed.all_reduce called at "), waiter["untracked"]
    assert "hang_program.py" in waiter["untracked"] and "in after_backward" in waiter["untracked"]
    assert any("in stuck_in_user_code" in f for f in report["ranks"]["1"]["stack"])


def test_rank_stuck_in_data_loading_under_the_trainer(tmp_path: Path) -> None:
    result = _run(tmp_path, "data_loading")
    report = _check_failed_job(tmp_path, result)
    culprit = report["ranks"]["1"]
    assert culprit["phase"] == "data loading", culprit
    assert any("in __getitem__" in f for f in culprit["stack"]) and any(
        "in stuck_in_user_code" in f for f in culprit["stack"]
    )
    assert "phase 'data loading'" in result.stderr


def test_stopped_rank_is_named_from_its_last_heartbeat(tmp_path: Path) -> None:
    result = _run(tmp_path, "sigstop")
    report = _check_failed_job(tmp_path, result)
    assert report["kind"] == "rank lost"
    assert "stopped" in report["why"]["1"] and "SIGSTOP" in report["why"]["1"]
    waiter = _waiter(report)
    assert TIMEOUT <= waiter["waiting_for"]
    culprit = report["ranks"]["1"]
    assert culprit["silent"] and culprit["step"] == 4  # its last heartbeat shows where it was
    assert any("in misbehave" in f for f in culprit["stack"]), culprit["stack"]


def test_a_rank_stuck_outside_fsdps_all_gather_is_named_by_a_sharded_run(tmp_path: Path) -> None:
    """A model cut by lockstep.shard (torch's FSDP2): the waiting rank's collective is FSDP's all-gather."""
    result = _run(tmp_path, "sharded_user_sleep")
    report = _check_failed_job(tmp_path, result)
    assert any("in stuck_in_user_code" in f for f in report["ranks"]["1"]["stack"]), report["ranks"]["1"]
    waiting = _waiter(report)["waiting"]
    assert waiting["op"].startswith("all_gather (FSDP unit "), waiting


def test_dead_rank_is_named_while_the_other_waits_in_an_allreduce(tmp_path: Path) -> None:
    result = _run(tmp_path, "die")
    report = _check_failed_job(tmp_path, result)
    assert report["kind"] == "rank lost" and "dead" in report["why"]["1"]
    waiter = _waiter(report)
    assert waiter["waiting"]["op"].startswith("allreduce")
    assert "raised" in waiter["failed"]  # gloo's error for the lost peer, reported, not hidden
    assert "rank 1 was killed by SIGKILL" in result.stderr


def test_skipped_backward_shows_where_the_collective_sequences_part(tmp_path: Path) -> None:
    result = _run(tmp_path, "skip_backward")
    report = _check_failed_job(tmp_path, result)
    div = report["divergence"]
    assert div is not None, report
    steps = {rank: rec["step"] for rank, rec in div["ranks"].items()}
    # The same sequence number, issued by rank 1 one step later than by rank 0: it skipped a backward.
    assert steps["1"] == steps["0"] + 1, div
    assert "Collective sequences part at #" in result.stderr


@pytest.mark.parametrize("case", ["shape_mismatch", "op_mismatch"])
def test_desync_names_both_call_sites(tmp_path: Path, case: str) -> None:
    result = _run(tmp_path, case)
    report = _check_failed_job(tmp_path, result, culprits=[[0], [1]])
    assert report["kind"] == "desync", report
    div = report["divergence"]
    assert div["differs_in"] == "op", div
    sites = {rank: rec["site"] for rank, rec in div["ranks"].items()}
    assert all("hang_program.py" in site and "in after_backward" in site for site in sites.values()), sites
    ops = {rank: (rec["op"], tuple(rec["shapes"])) for rank, rec in div["ranks"].items()}
    assert ops["0"] != ops["1"]


@pytest.mark.parametrize(
    ("case", "timeout"), [("straggler", 10.0), ("slow_checkpoint", TIMEOUT), ("slow_first_step", TIMEOUT)]
)
def test_no_false_alarm(tmp_path: Path, case: str, timeout: float) -> None:
    """A 3 s straggler under a 10 s timeout, a 9 s rank-0 checkpoint and a 9 s first step under 4 s."""
    result = _run(tmp_path, case, timeout)
    assert result.returncode == 0, result.stderr
    assert "HANG" not in result.stderr
    assert not (tmp_path / "out" / "hang_report.json").exists()
    assert "rank 0 finished" in result.stdout


def test_without_the_launcher_every_rank_prints_the_report(tmp_path: Path) -> None:
    """Plain env:// (what srun or a hand-written launcher gives): the ranks judge and report themselves."""
    port = str(free_port())  # rank 0 binds it: asked of the kernel, not guessed
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROGRAM), "user_sleep", str(tmp_path)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                LOCKSTEP_HANG_TIMEOUT=f"{TIMEOUT:g}",
            ),
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == STALL_EXIT_CODE, err
        assert "lockstep: HANG DETECTED (stall" in err and "rank 1 busy in phase 'between steps'" in err, err
        assert "in stuck_in_user_code" in err
    _assert_no_process_left(tmp_path)
