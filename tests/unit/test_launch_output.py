"""The launcher's console rules and failure summary, on files written by the test (no process started)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from lockstep.launch.console_relay import Console, ConsoleRelay
from lockstep.launch.failure_report import RankFailure, first_failure, format_failure


def _relay(tmp_path: Path, logs: str, files: dict[int, tuple[str, str]]) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    relay = ConsoleRelay(Console(out, err), logs=logs, interval=0.01)
    for rank, (stdout, stderr) in files.items():
        (tmp_path / f"o{rank}").write_text(stdout)
        (tmp_path / f"e{rank}").write_text(stderr)
        relay.follow(rank, str(tmp_path / f"o{rank}"), str(tmp_path / f"e{rank}"))
    relay.stop()  # never started: stop() still drains everything once
    return out.getvalue(), err.getvalue()


def test_rank0_verbatim_others_only_warnings_and_errors(tmp_path: Path) -> None:
    tb = 'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n    f()\nValueError: bad\n'
    out, err = _relay(
        tmp_path,
        "rank0",
        {
            0: ("step 1\nbar 10%\rbar 100%\n", "rank0 warning\n"),
            1: (
                "chatty stdout\nWARNING: low disk\n",
                "t.py:3: UserWarning: careful\n" + tb + "progress 5%\rprogress 9%\n",
            ),
        },
    )
    assert out == "step 1\nbar 10%\rbar 100%\n"  # byte for byte: progress bars keep their \r
    assert "rank0 warning\n" in err
    assert "chatty stdout" not in out + err
    assert "[rank 1] WARNING: low disk" in err
    assert "[rank 1] t.py:3: UserWarning: careful" in err
    # The traceback folds to its exception line plus where the rest is.
    assert f"[rank 1] ValueError: bad  (traceback in {tmp_path / 'e1'})" in err
    assert 'File "t.py"' not in err
    assert "[rank 1] progress 9%" in err and "progress 5%" not in err


def test_logs_all_prefixes_every_line_once(tmp_path: Path) -> None:
    out, err = _relay(tmp_path, "all", {0: ("a\n", ""), 1: ("b\n", "[rank 1/2] WARNING x: y\n")})
    assert out.splitlines() == ["[rank 0] a", "[rank 1] b"]
    assert err.splitlines() == ["[rank 1/2] WARNING x: y"]  # already prefixed by lockstep's logger


def _record(message: str, when: float) -> dict[str, object]:
    return {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": f"Traceback...\n{message}\n",
                "timestamp": str(int(when)),
                "lockstep_time": when,
            },
        }
    }


def test_first_failure_is_the_root_cause() -> None:
    raised_late = RankFailure(0, 0, 100, 1, _record("RuntimeError: peer closed", 10.5), None)
    raised_early = RankFailure(1, 1, 101, 1, _record("ValueError: bad", 10.2), None)
    stopped = RankFailure(2, 2, 102, -15, {}, None)
    interrupted = RankFailure(3, 3, 103, 130, _record("KeyboardInterrupt", 10.0), None)
    assert first_failure([raised_late, stopped, raised_early, interrupted]) is raised_early
    segfault = RankFailure(4, 0, 104, -11, {}, None)
    assert first_failure([raised_late, segfault, stopped]) is segfault


def test_summary_block(tmp_path: Path) -> None:
    rank_dir = tmp_path / "rank1"
    rank_dir.mkdir()
    (rank_dir / "stdout.log").write_text("epoch 1\n")
    (rank_dir / "stderr.log").write_text("loading\nTraceback (most recent call last):\nValueError: bad\n")
    failures = [
        RankFailure(1, 1, 101, 1, _record("ValueError: bad", 1.0), str(rank_dir)),
        RankFailure(0, 0, 100, -15, {}, None),
    ]
    text = format_failure(failures, 2)
    assert text.count("FAILED") == 1
    assert "FAILED: rank 1/2 (local rank 1, pid 101) exited with code 1" in text
    assert "Traceback...\nValueError: bad" in text
    assert "  loading" in text and "  epoch 1" in text
    assert str(rank_dir / "stderr.log") in text
    assert "also: rank 0 was killed by SIGTERM (exit code -15) (stopped by the launcher)" in text
    crash = format_failure([RankFailure(0, 0, 100, -11, {}, str(rank_dir))], 1)
    assert (
        "killed by SIGSEGV" in crash and "no Python traceback was recorded" in crash and "<N/A>" not in crash
    )


def test_rank_stopped_while_exiting_keeps_the_code_it_chose() -> None:
    """A rank that raised (its record says it exits 1) and was SIGTERMed by the agent in its atexit work,
    because a peer's failure was seen first, is reported as exiting 1: the launcher does not exit 143."""
    record = {
        "message": {
            "message": "ValueError: bad",
            "extraInfo": {
                "py_callstack": "Traceback...\nValueError: bad\n",
                "lockstep_time": 1.0,
                "lockstep_exitcode": 1,
            },
        }
    }
    raised = RankFailure(1, 1, 101, -15, record, None)
    peer = RankFailure(0, 0, 100, 1, _record("RuntimeError: Connection closed by peer", 1.2), None)
    assert first_failure([peer, raised]) is raised and raised.exit_status == 1
    assert (
        "FAILED: rank 1/2 (local rank 1, pid 101) exited with code 1 (stopped by the launcher while exiting)"
        in format_failure([peer, raised], 2)
    )
    # Killed by a signal that is not the launcher's stop (a crash), or with no code recorded: the signal stands.
    assert RankFailure(1, 1, 101, -11, record, None).exit_status == -11
    assert RankFailure(1, 1, 101, -15, _record("ValueError: bad", 1.0), None).exit_status == -15


def test_an_error_raised_inside_lockstep_names_the_programs_call() -> None:
    """A framework's call into lockstep that raises (issue 37: Lightning's `model.reducer...` deep in a
    40-frame traceback whose last frame is lockstep's): the summary names the call site on its own line."""
    from lockstep.errors import ConfigError
    from lockstep.launch import worker
    from lockstep.launch.flag_values import int_flag

    with pytest.raises(ConfigError) as raised:
        int_flag("two", "-n", "lockstep run")  # raises inside lockstep, called from here
    site = worker._call_site(raised.value.__traceback__)
    assert site is not None and "test_launch_output.py" in site and 'int_flag("two", "-n"' in site, site
    with pytest.raises(ValueError) as own:
        int("two")  # raised outside lockstep: the traceback's last frame already says where
    assert worker._call_site(own.value.__traceback__) is None
    record = _record("ConfigError: bad", 1.0)
    record["message"]["extraInfo"]["lockstep_call_site"] = site  # type: ignore[index]
    summary = format_failure([RankFailure(0, 0, 100, 1, record, None)], 1)
    assert f"[rank 0] the failing call into lockstep: {site}" in summary
