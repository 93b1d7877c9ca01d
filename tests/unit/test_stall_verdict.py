"""The stall judgement and report (runtime/stall_verdict.py) on hand-made rank states: who is blamed, when
a slow phase is allowed, and what the report says. No processes: the states are what ranks publish."""

from __future__ import annotations

from typing import Any

import pytest

from lockstep.errors import ConfigError
from lockstep.runtime.env.topology import DEFAULT_HANG_TIMEOUT, hang_timeout_from_env
from lockstep.runtime.stall_verdict import (
    BUSY,
    EXITED,
    SILENT,
    WAITING,
    classify,
    divergence,
    evictable_culprits,
    format_report,
    judge,
)

TIMEOUT, SLOW = 10.0, 5.0


def coll(
    seq: int,
    op: str = "allreduce (gradient bucket)",
    shapes: tuple[str, ...] = ("float32[161]",),
    step: int = 7,
) -> dict[str, Any]:
    return {
        "seq": seq,
        "op": op,
        "group": "world",
        "shapes": list(shapes),
        "step": step,
        "phase": "backward",
        "site": "train.py:40 in main",
    }


def waiting(seq: int = 13, **kw: Any) -> dict[str, Any]:
    c = coll(seq, **kw)
    return {
        "step": c["step"],
        "steps_done": 6,
        "phase": "backward",
        "phase_for": 12.0,
        "waiting": c,
        "waiting_for": 12.0,
        "recent": [c],
    }


def busy(phase: str = "between steps", phase_for: float = 12.0, steps_done: int = 6) -> dict[str, Any]:
    return {
        "step": 7,
        "steps_done": steps_done,
        "phase": phase,
        "phase_for": phase_for,
        "waiting": None,
        "recent": [],
        "stack": ["train.py:20 in load"],
    }


def test_classify() -> None:
    assert classify(waiting()) == WAITING
    assert classify(busy()) == BUSY
    assert classify({**busy(), "silent": True}) == SILENT
    assert classify({**waiting(), "exited": True}) == EXITED
    assert classify({**busy(), "untracked": "torch.distributed.all_reduce called at a.py:1 in f"}) == WAITING


def test_busy_rank_is_the_culprit() -> None:
    verdict = judge(0, {0: waiting(), 1: busy(), 2: waiting()}, TIMEOUT, SLOW)
    assert verdict is not None
    assert verdict["kind"] == "stall" and verdict["culprits"] == [1] and verdict["waiting"] == [0, 2]
    assert verdict["summary"].startswith(
        "rank 1 busy in phase 'between steps' for 12.0 s; ranks 0, 2 wait in"
    )
    assert "allreduce (gradient bucket) #13 (world) at step 7" in verdict["summary"]


@pytest.mark.parametrize("phase", ["checkpoint", "evaluate", "joining"])
def test_slow_phase_is_allowed_longer(phase: str) -> None:
    assert judge(0, {0: waiting(), 1: busy(phase, phase_for=40.0)}, TIMEOUT, SLOW) is None
    verdict = judge(0, {0: waiting(), 1: busy(phase, phase_for=51.0)}, TIMEOUT, SLOW)
    assert verdict is not None and verdict["culprits"] == [1]


def test_first_steps_are_allowed_longer() -> None:
    assert judge(0, {0: waiting(), 1: busy(steps_done=0, phase_for=30.0)}, TIMEOUT, SLOW) is None
    assert judge(0, {0: waiting(), 1: busy(steps_done=2, phase_for=30.0)}, TIMEOUT, SLOW) is not None


def test_within_the_timeout_is_not_a_hang() -> None:
    assert judge(0, {0: waiting(), 1: busy(phase_for=9.0)}, TIMEOUT, SLOW) is None


def test_silent_and_exited_ranks_are_lost() -> None:
    silent = {
        **busy(),
        "silent": True,
        "liveness": "stopped: its process (pid 7) is stopped (SIGSTOP or a debugger)",
    }
    verdict = judge(0, {0: waiting(), 1: silent, 2: {**busy(), "exited": True}}, TIMEOUT, SLOW)
    assert verdict is not None and verdict["kind"] == "rank lost" and verdict["culprits"] == [1, 2]
    assert "SIGSTOP" in verdict["why"]["1"] and "exited" in verdict["why"]["2"]


def test_live_mode_evicts_silent_ranks_and_replacements_too_slow_to_join_not_busy_members() -> None:
    """A replacement busy setting up (phase 'joining') past its allowance keeps the members waiting for
    nothing they need: live mode evicts it as it does a silent rank. A busy member is a hang to report."""
    silent = {**busy(), "silent": True, "liveness": "stopped"}
    states = {0: waiting(), 1: silent, 2: busy("joining", phase_for=51.0), 3: busy(phase_for=51.0)}
    verdict = judge(0, states, TIMEOUT, SLOW)
    assert verdict is not None and verdict["culprits"] == [1, 2, 3]
    assert evictable_culprits({**verdict, "states": states}) == [1, 2]


def test_same_sequence_number_other_shapes_is_a_desync() -> None:
    other = waiting(13, op="allreduce (sum)", shapes=("float64[2]",))
    verdict = judge(0, {0: waiting(13), 1: other}, TIMEOUT, SLOW)
    assert verdict is not None and verdict["kind"] == "desync" and verdict["culprits"] == [1]
    assert "collective mismatch" in verdict["why"]["1"]
    assert verdict["divergence"]["seq"] == 13 and verdict["divergence"]["differs_in"] == "op"
    assert "Collective sequences part at #13 (world)" in verdict["summary"]


def test_other_sequence_number_is_a_divergence() -> None:
    verdict = judge(0, {0: waiting(13), 1: waiting(15)}, TIMEOUT, SLOW)
    assert (
        verdict is not None and verdict["kind"] == "diverged" and "sequences diverged" in verdict["why"]["1"]
    )


def test_everyone_in_the_same_collective() -> None:
    verdict = judge(0, {0: waiting(13), 1: waiting(13)}, TIMEOUT, SLOW)
    assert verdict is not None and verdict["kind"] == "all waiting" and verdict["culprits"] == []


def test_failed_collective_does_not_wait_for_allowances() -> None:
    mine = {**waiting(), "failed": "allreduce #13 raised RuntimeError: Connection reset by peer"}
    verdict = judge(0, {0: mine, 1: busy(phase_for=1.0)}, TIMEOUT, SLOW)
    assert verdict is not None and verdict["culprits"] == [1]


def test_divergence_finds_the_first_step_shift() -> None:
    rank0 = {"recent": [coll(11, step=3), coll(12, step=4), coll(13, step=5)]}
    rank1 = {"recent": [coll(11, step=3), coll(12, step=5), coll(13, step=6)]}
    div = divergence({0: rank0, 1: rank1})
    assert div is not None and div["seq"] == 12 and div["differs_in"] == "step"
    assert divergence({0: rank0, 1: rank0}) is None


def test_format_report_names_culprit_stack_and_path() -> None:
    verdict = judge(0, {0: waiting(), 1: busy()}, TIMEOUT, SLOW)
    assert verdict is not None
    verdict["ranks"] = {"0": waiting(), "1": busy()}
    verdict["path"] = "/runs/a/hang_report.json"
    text = format_report(verdict)
    assert "lockstep: HANG DETECTED (stall, hang timeout 10.0 s)" in text
    assert "[rank 1] CULPRIT: busy, at step 7, phase 'between steps'" in text
    assert "train.py:20 in load" in text and "/runs/a/hang_report.json" in text


def test_hang_timeout_from_env() -> None:
    assert hang_timeout_from_env({}) == DEFAULT_HANG_TIMEOUT == 300.0
    assert hang_timeout_from_env({"LOCKSTEP_HANG_TIMEOUT": "0"}) == 0.0
    assert hang_timeout_from_env({"LOCKSTEP_HANG_TIMEOUT": "12.5"}) == 12.5
    for bad in ("-1", "ten"):
        with pytest.raises(ConfigError, match="LOCKSTEP_HANG_TIMEOUT"):
            hang_timeout_from_env({"LOCKSTEP_HANG_TIMEOUT": bad})
