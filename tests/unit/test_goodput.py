"""The run's time account (runtime/run_account.py): training and the causes add up to the wall time from the
first step to the last; lost phases, discarded work, restarts and transfers land where they belong.

One process, real clocks: each test sleeps a few tens of milliseconds in known phases and checks the
account against those spans with a tolerance far above timer noise and far below the spans themselves.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

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

    class Side:
        member_id, restarts = 0, 1

    runlog = RunLog(tmp_path, enabled=True)
    at_checkpoint = {**ACCOUNT.state_dict(), "started": time.time(), "samples_lost": 0}
    try:
        records = RunRecords(tmp_path, Side(), 0)
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
