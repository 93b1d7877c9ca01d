"""The run's time account (runtime/run_account.py): training and the causes add up to the wall time from the
first step to the last; lost phases, discarded work, restarts and transfers land where they belong.

One process, real clocks: each test sleeps a few tens of milliseconds in known phases and checks the
account against those spans with a tolerance far above timer noise and far below the spans themselves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from lockstep.checkpoint import CheckpointManager
from lockstep.runtime.env.topology import Topology
from lockstep.runtime.progress import (
    CHECKPOINT,
    EVALUATE,
    FORWARD,
    PROGRESS,
    RECOVERY,
    STATE_TRANSFER,
    CollectiveRecord,
    phase,
)
from lockstep.runtime.run_account import ACCOUNT, CAUSES, RunAccount
from lockstep.trainer.reporting.run_log import RunLog
from lockstep.trainer.reporting.run_records import RunRecords

SPAN = 0.05  # seconds slept per span
TOL = 0.03  # sleeping overshoots a little on a busy machine; never by a whole span


def _adds_up(summary: dict[str, Any]) -> None:
    assert set(summary["lost_s_by_cause"]) == set(CAUSES)
    total = summary["training_s"] + sum(summary["lost_s_by_cause"].values())
    assert total == pytest.approx(summary["goodput_wall_s"], abs=0.01)
    # from the rounded seconds (3 decimals) of spans a tenth of a second long: a percent apart at most
    assert summary["goodput"] == pytest.approx(summary["training_s"] / summary["goodput_wall_s"], abs=0.02)


class Side:
    """What RunRecords asks of the run's side (trainer/live/live_side.py): member 0 (rank 0 now, not a
    replacement), `restarts` before."""

    joining = False

    def __init__(self, restarts: int = 0) -> None:
        self.member_id, self.restarts = 0, restarts

    def topology(self) -> Topology:
        return Topology()


@pytest.fixture
def account() -> RunAccount:
    PROGRESS.set_phase(FORWARD)
    return RunAccount()


def test_before_the_first_step_there_is_nothing_to_account(account: RunAccount) -> None:
    summary = account.summary()
    assert summary["goodput"] is None and summary["samples_lost"] == 0
    assert set(summary["lost_s_by_cause"].values()) == {0.0}


def test_time_in_checkpoint_and_evaluation_is_lost_to_them_and_the_rest_is_training(
    account: RunAccount,
) -> None:
    time.sleep(SPAN)  # before the first step: not the run's wall time
    account.step_began()
    time.sleep(SPAN)
    with phase(CHECKPOINT):
        time.sleep(SPAN)
    with phase(EVALUATE):
        time.sleep(SPAN)
    account.step_ended()
    summary = account.summary()
    _adds_up(summary)
    lost = summary["lost_s_by_cause"]
    assert lost["checkpoint_stall"] == pytest.approx(SPAN, abs=TOL)
    assert lost["evaluation"] == pytest.approx(SPAN, abs=TOL)
    assert summary["goodput_wall_s"] == pytest.approx(3 * SPAN, abs=TOL)
    assert summary["goodput"] == pytest.approx(1 / 3, abs=0.15)


def test_work_after_the_last_step_is_outside_the_wall_time(account: RunAccount) -> None:
    account.step_began()
    time.sleep(SPAN)
    account.step_ended()
    before = account.summary()
    with phase(CHECKPOINT):  # the run's last save, after its last step
        time.sleep(SPAN)
    after = account.summary()
    assert after == before
    assert account.summary(upto_now=True)["lost_s_by_cause"]["checkpoint_stall"] >= SPAN * 0.9


def test_discarded_work_is_redone_work_and_the_failed_wait_is_hang_detection(account: RunAccount) -> None:
    account.step_began()
    time.sleep(SPAN)
    started = account.point()
    time.sleep(SPAN)  # the attempt's own work
    record = CollectiveRecord(1, "all_reduce", "world", [], 1, FORWARD, "here")
    PROGRESS.begin_wait(record)  # waits for a peer that died: the collective fails at the end
    try:
        time.sleep(2 * SPAN)
        account.discard(started)
    finally:
        PROGRESS.end_wait()
    with phase(RECOVERY):
        time.sleep(SPAN)
        with phase(STATE_TRANSFER):
            time.sleep(SPAN)
    account.step_ended()
    summary = account.summary()
    _adds_up(summary)
    lost = summary["lost_s_by_cause"]
    assert lost["redone_work"] == pytest.approx(SPAN, abs=TOL)
    assert lost["hang_detection"] == pytest.approx(2 * SPAN, abs=TOL)
    assert lost["reformation"] == pytest.approx(SPAN, abs=TOL)
    assert lost["state_transfer"] == pytest.approx(SPAN, abs=TOL)
    assert summary["redos"] == 1 and summary["samples_lost"] == 0
    assert summary["training_s"] == pytest.approx(SPAN, abs=TOL)  # the first span only


def test_a_wait_that_began_before_the_discarded_work_is_not_its_detection(account: RunAccount) -> None:
    account.step_began()
    record = CollectiveRecord(1, "all_reduce", "world", [], 1, FORWARD, "here")
    PROGRESS.begin_wait(record)
    try:
        time.sleep(SPAN)
        started = account.point()
        time.sleep(SPAN)
        account.discard(started)
    finally:
        PROGRESS.end_wait()
    lost = account.summary(upto_now=True)["lost_s_by_cause"]
    assert lost["hang_detection"] == 0.0 and lost["redone_work"] == pytest.approx(SPAN, abs=TOL)


def test_a_restart_carries_the_account_on_and_loses_the_time_since_the_checkpoint(
    account: RunAccount,
) -> None:
    account.step_began()
    with phase(EVALUATE):
        time.sleep(SPAN)
    account.lose_samples(16)
    saved = account.state_dict()
    time.sleep(2 * SPAN)  # the crashed attempt's work after the checkpoint, the new processes' start
    restarted = RunAccount()
    restarted.arriving = "restart"
    restarted.load_state_dict(saved)
    restarted.step_began()
    time.sleep(SPAN)
    restarted.step_ended()
    summary = restarted.summary()
    _adds_up(summary)
    lost = summary["lost_s_by_cause"]
    assert lost["restart"] == pytest.approx(2 * SPAN, abs=TOL)
    assert lost["evaluation"] == pytest.approx(SPAN, abs=TOL)  # carried from the checkpoint
    assert summary["goodput_wall_s"] == pytest.approx(4 * SPAN, abs=TOL)
    assert summary["samples_lost"] == 16 and "between_jobs_s" not in summary


def test_a_new_job_resuming_a_run_leaves_the_time_between_jobs_out(account: RunAccount) -> None:
    account.step_began()
    time.sleep(SPAN)
    saved = account.state_dict()
    time.sleep(2 * SPAN)
    resumed = RunAccount()
    resumed.arriving = "new job"
    resumed.load_state_dict(saved)
    resumed.step_began()
    time.sleep(SPAN)
    resumed.step_ended()
    summary = resumed.summary()
    _adds_up(summary)
    assert summary["between_jobs_s"] == pytest.approx(2 * SPAN, abs=TOL)
    assert summary["goodput_wall_s"] == pytest.approx(2 * SPAN, abs=TOL)
    assert summary["lost_s_by_cause"]["restart"] == 0.0
    assert summary["goodput"] == pytest.approx(1.0, abs=0.05)


def test_a_replacement_takes_the_account_over_as_it_stood(account: RunAccount) -> None:
    account.step_began()
    with phase(CHECKPOINT):
        time.sleep(SPAN)
    sent = account.state_dict()
    joiner = RunAccount()  # arriving: "transfer", the default
    joiner.load_state_dict(sent)
    joiner.step_began()
    time.sleep(SPAN)
    joiner.step_ended()
    summary = joiner.summary()
    _adds_up(summary)
    assert summary["lost_s_by_cause"]["checkpoint_stall"] == pytest.approx(SPAN, abs=TOL)
    assert summary["lost_s_by_cause"]["restart"] == 0.0
    assert joiner.started == account.started


@pytest.mark.parametrize("state", [{}, {"format": 0, "started": 1.0}, {"format": 1, "started": None}])
def test_an_account_from_an_older_checkpoint_or_before_any_step_starts_afresh(
    account: RunAccount, state: dict[str, Any]
) -> None:
    account.arriving = "restart"
    account.load_state_dict(state)
    assert account.started is None
    account.step_began()
    assert account.summary(upto_now=True)["lost_s_by_cause"]["restart"] == 0.0


def test_restarts_from_the_same_checkpoint_add_their_lost_samples_up(tmp_path: Path) -> None:
    """Two restarts resume from the same checkpoint (taken at step 200, nothing lost then): the second
    loses what the first had lost (in rank 0's step file, which the checkpoint predates) and its own."""

    runlog = RunLog(tmp_path, enabled=True)
    at_checkpoint = {**ACCOUNT.state_dict(), "started": time.time(), "samples_lost": 0}
    try:
        records = RunRecords(tmp_path, Side(restarts=1), 0, CheckpointManager(tmp_path))
        runlog.reached(300, 0)  # the first attempt came to step 300
        ACCOUNT.load_state_dict(at_checkpoint)
        records.resumed(200, runlog, global_batch=8)
        assert ACCOUNT.samples_lost == 100 * 8
        runlog.reached(260, ACCOUNT.samples_lost)  # the second attempt came to step 260
        ACCOUNT.load_state_dict(at_checkpoint)  # the third resumes from the same checkpoint
        records.resumed(200, runlog, global_batch=8)
        assert ACCOUNT.samples_lost == (100 + 60) * 8
        assert runlog.last_step() == (260, 800)
    finally:
        records.close()
        runlog.close()
        ACCOUNT.reset()


def test_a_failed_wait_inside_an_evaluation_is_counted_once(account: RunAccount) -> None:
    """The wait that failed lies in the evaluation's phase: it is the evaluation's time, not detection too."""
    account.step_began()
    time.sleep(SPAN)
    account.step_ended()
    started = account.point()
    try:
        with phase(EVALUATE):
            PROGRESS.begin_wait(CollectiveRecord(1, "all_reduce", "world", [], 1, EVALUATE, "here"))
            time.sleep(2 * SPAN)  # a peer died: the wait fails, and the error leaves the phase
            raise RuntimeError("peer lost")
    except RuntimeError:
        account.discard(started)  # as the step driver does: the failed wait is still the current one
    finally:
        PROGRESS.end_wait()
    summary = account.summary()
    _adds_up(summary)
    lost = summary["lost_s_by_cause"]
    assert lost["evaluation"] == pytest.approx(2 * SPAN, abs=TOL)
    assert lost["hang_detection"] + lost["redone_work"] < TOL, lost


def test_work_discarded_after_the_last_step_stays_inside_the_wall_time(account: RunAccount) -> None:
    account.step_began()
    time.sleep(SPAN)
    account.step_ended()
    started = account.point()  # the run's end: an evaluation, a save, cut short by a loss
    time.sleep(SPAN)
    account.discard(started)
    summary = account.summary()
    _adds_up(summary)
    assert summary["goodput_wall_s"] == pytest.approx(2 * SPAN, abs=TOL)
    assert summary["lost_s_by_cause"]["redone_work"] == pytest.approx(SPAN, abs=TOL)


def test_a_replacement_counts_the_state_on_its_way_as_state_transfer(account: RunAccount) -> None:
    account.step_began()
    sent = account.state_dict()
    time.sleep(SPAN)  # the broadcast of the state to the replacement
    joiner = RunAccount()
    joiner.load_state_dict(sent)
    joiner.step_began()
    time.sleep(SPAN)
    joiner.step_ended()
    summary = joiner.summary()
    _adds_up(summary)
    assert summary["lost_s_by_cause"]["state_transfer"] == pytest.approx(SPAN, abs=TOL)


def test_a_restart_without_a_checkpoint_loses_the_crashed_attempt_whole(account: RunAccount) -> None:
    began = time.time()
    time.sleep(SPAN)  # the crashed attempt, from its first step; then the new processes' start
    account.restarted_from_scratch(began)
    account.step_began()
    time.sleep(SPAN)
    account.step_ended()
    summary = account.summary()
    _adds_up(summary)
    assert summary["lost_s_by_cause"]["restart"] == pytest.approx(SPAN, abs=TOL)
    assert summary["goodput_wall_s"] == pytest.approx(2 * SPAN, abs=TOL)


def test_a_fresh_run_in_a_used_run_directory_loses_nothing_and_leaves_no_old_part(tmp_path: Path) -> None:
    """Files of an earlier run (its step file, a part of a member this run does not have) are not this
    run's: no samples lost, the old part gone as rank 0 opens; a part another rank of this run writes
    after that (a fast rank's first step, before rank 0 is through its checkpoint's look) is kept."""

    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "attempt1-member5.json").write_text("{}")
    runlog = RunLog(tmp_path, enabled=True)
    runlog.reached(500, 0)
    try:
        records = RunRecords(tmp_path, Side(), 0, CheckpointManager(tmp_path))
        assert not (tmp_path / "trace" / "attempt1-member5.json").exists()
        (tmp_path / "trace" / "attempt0-member1.json").write_text("{}")
        records.resumed(None, runlog, global_batch=64)
        assert ACCOUNT.samples_lost == 0
        assert (tmp_path / "trace" / "attempt0-member1.json").exists()
    finally:
        records.close()
        runlog.close()
        ACCOUNT.reset()


def test_old_parts_beside_checkpoints_none_loaded_go_and_this_runs_parts_stay(tmp_path: Path) -> None:
    """A used run directory whose checkpoints do not load: the parts found at the open go once that is
    known; the parts this run's ranks write after the open stay, a new member's and an old name written
    again, at once after the open (a file's time lags the clock: a clock reading cut kept one once)."""

    manager = CheckpointManager(tmp_path)
    manager.dirs.layout.step_dir(200).mkdir(parents=True)  # a checkpoint directory (not loadable)
    (tmp_path / "trace").mkdir()
    for name in ("attempt0-member1", "attempt1-member5"):
        (tmp_path / "trace" / f"{name}.json").write_text("{}")
    runlog = RunLog(tmp_path, enabled=True)
    try:
        records = RunRecords(tmp_path, Side(), 0, manager)
        assert (tmp_path / "trace" / "attempt1-member5.json").exists()  # the checkpoints are not tried yet
        again = tmp_path / "trace" / "attempt0-member1.json"
        before = again.stat().st_mtime_ns
        again.write_text('{"again": 1}')
        os.utime(again, ns=(before + 1, before + 1))  # written after the open, its time before it
        (tmp_path / "trace" / "attempt0-member2.json").write_text("{}")
        records.resumed(None, runlog, global_batch=64)
        left = sorted(p.stem for p in (tmp_path / "trace").glob("*.json"))
        assert left == ["attempt0-member1", "attempt0-member2"]
    finally:
        records.close()
        runlog.close()
        ACCOUNT.reset()


def test_a_timeline_that_cannot_be_written_costs_the_trace_not_the_run(tmp_path: Path) -> None:
    """At the run's end or after a failure the last write fails (the trace folder is gone, a file in its
    place): nothing raises, and the timeline stops recording all the same."""

    for end in (RunRecords.close, RunRecords.failed):
        run_dir = tmp_path / end.__name__
        RunRecords(run_dir, Side(), 0, CheckpointManager(run_dir))
        assert PROGRESS.clock.timeline is not None
        (run_dir / "trace").rmdir()
        (run_dir / "trace").write_text("not a folder")
        end()  # logged, not raised
        assert PROGRESS.clock.timeline is None and not PROGRESS.loop_driven
    ACCOUNT.reset()


def test_a_run_whose_checkpoints_are_all_unusable_clears_the_old_parts_once_it_starts_afresh(
    tmp_path: Path,
) -> None:
    """An earlier run left a checkpoint that does not load and a part: rank 0 keeps the parts as it opens
    (a checkpoint might resume them), and once none loaded clears those last written before it opened,
    never one this run wrote meanwhile."""
    (tmp_path / "checkpoints" / "step_000010").mkdir(parents=True)  # no meta.json: unusable
    (tmp_path / "trace").mkdir()
    old = tmp_path / "trace" / "attempt0-member5.json"
    old.write_text("{}")
    os.utime(old, (time.time() - 60, time.time() - 60))
    runlog = RunLog(tmp_path, enabled=True)
    try:
        records = RunRecords(tmp_path, Side(), 0, CheckpointManager(tmp_path))
        assert old.exists()
        (tmp_path / "trace" / "attempt0-member1.json").write_text("{}")  # this run's, after the open
        records.resumed(None, runlog, global_batch=64)
        assert not old.exists() and (tmp_path / "trace" / "attempt0-member1.json").exists()
    finally:
        records.close()
        runlog.close()
        ACCOUNT.reset()
