"""runtime/progress.py: where a live member's start-up is timed from (the hang watchdog's allowance)."""

from __future__ import annotations

import time

from lockstep.runtime.progress import JOINING, SLOW_PHASES, STARTUP, Progress


def test_the_first_group_formed_times_the_start_up_from_then() -> None:
    """Imports and the wait for the others to check in kept nobody waiting: the allowance starts later."""
    progress = Progress()
    progress.phase_since -= 30.0  # a process that took 30 s to import torch on a loaded machine
    marker = progress.marker
    progress.phase_starts_now()
    snapshot = progress.snapshot(time.time())
    assert snapshot["phase"] == STARTUP and snapshot["phase_for"] < 1.0
    assert progress.marker == marker + 1  # the watchdog sees it moving


def test_a_replacement_setting_up_after_its_admission_is_a_slow_phase() -> None:
    progress = Progress()
    progress.set_phase(JOINING)
    assert progress.snapshot()["phase"] == JOINING and JOINING in SLOW_PHASES
