"""The run's account of its time: goodput, and the time lost by cause.

Goodput is the time of the steps that counted over the wall time from the run's first step to its last
(the field's figure: Llama 3's "effective training time", Google's ml-goodput-measurement). Every second of
that wall time falls into exactly one bucket, as this process's main thread lived it:

- a phase that is not training: the PhaseClock (runtime/phase_clock.py) times every phase of the main
  thread, and the time in CHECKPOINT, EVALUATE, RECOVERY, STATE_TRANSFER and JOINING is lost to that cause
  (`CAUSE_OF_PHASE`);
- redone work: a step (or work between steps) in which a member was lost is done again
  (trainer/run/step_driver.py): the failed attempt's training time is lost, and the part of it spent in the
  collective that failed, waiting for a peer that would never answer, is hang detection. A
  low-communication run that goes back to its round's mark loses its training since the mark;
- restart: a whole-job restart resumes from the last checkpoint, and everything from the moment that
  checkpoint was taken to the resumed attempt's first step is lost (the work after it, the failure, the
  new processes' start, the load). A new job that resumes a run leaves the time between the jobs out of
  the wall time (`between_jobs_s`): nobody was running then;
- the rest is training: the steps that counted.

So training and the causes add up to the wall time exactly. The account travels with the run's state: a
checkpoint holds it (a restart carries on from it) and a replacement receives it with the rest (live mode),
so whichever process ends up as rank 0 reports the whole run.

`samples_lost` counts the samples of steps that had counted and were undone: those after the checkpoint a
restart resumed from. Live mode never undoes a counted step (a step counts on every member or on none), so
it loses none; a step redone over the survivors is redone work, not lost samples.

One `RunAccount` per process (`ACCOUNT`), like PROGRESS: what an engine, `fit` and `LiveLoop` know goes
in from wherever they are; the hot path (one call per step start and end) copies 16 doubles at most.
"""

from __future__ import annotations

import os
import time
from array import array
from dataclasses import dataclass
from typing import Any

from lockstep.runtime.phase_clock import MAX_PHASES
from lockstep.runtime.progress import (
    CHECKPOINT,
    EVALUATE,
    JOINING,
    PROGRESS,
    RECOVERY,
    STATE_TRANSFER,
)

REFORMATION = "reformation"
REDONE_WORK = "redone_work"
HANG_DETECTION = "hang_detection"
STATE_TRANSFER_CAUSE = "state_transfer"
CHECKPOINT_STALL = "checkpoint_stall"
RESTART = "restart"
EVALUATION = "evaluation"
CAUSES = (
    REFORMATION,
    REDONE_WORK,
    HANG_DETECTION,
    STATE_TRANSFER_CAUSE,
    CHECKPOINT_STALL,
    RESTART,
    EVALUATION,
)
CAUSE_OF_PHASE = {
    RECOVERY: REFORMATION,
    STATE_TRANSFER: STATE_TRANSFER_CAUSE,
    JOINING: STATE_TRANSFER_CAUSE,  # a replacement before it trains: receiving the run's state
    CHECKPOINT: CHECKPOINT_STALL,
    EVALUATE: EVALUATION,
}
LOST_PHASES = frozenset(CAUSE_OF_PHASE)
FORMAT = 1  # the account's state_dict layout


@dataclass(frozen=True)
class Point:
    """A moment of the run and the seconds lost so far: work since it can be discarded honestly."""

    wall: float
    lost: float


class RunAccount:
    """This process's account of the run's time (see the module doc)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new run in this process (each `fit` call, each test in a pooled worker)."""
        self.started: float | None = None  # wall time of the run's first step
        self.last_end: float | None = None  # wall time of the last step's end
        self.carried: dict[str, float] = dict.fromkeys(CAUSES, 0.0)  # loaded, and what events added
        self.samples_lost = 0
        self.redos = 0
        self.between_jobs_s = 0.0
        self._zero = array("d", [0.0] * MAX_PHASES)  # the clock's totals when this account began
        self._at_end = array("d", [0.0] * MAX_PHASES)  # the clock's totals at the last step's end
        self._arrival: tuple[str, float] | None = None  # a resumed run's gap to close at its first step
        self.arriving = "transfer"  # how a loaded account arrives: "restart", "new job" or "transfer"

    # ------------------------------------------------------------------ the main thread, per step

    def step_began(self) -> None:
        """A step starts (Progress.begin_step): the first one starts the account."""
        if self.started is not None and self._arrival is None:
            return
        now = time.time()
        if self.started is None:
            self.started = now
            self._zero[:] = PROGRESS.clock.totals
        if self._arrival is not None:
            kind, since = self._arrival
            self._arrival = None
            gap = max(0.0, now - since)
            if kind == RESTART:
                self.carried[RESTART] += gap
            else:
                self.between_jobs_s += gap
            self._zero[:] = PROGRESS.clock.totals  # what this process did before its first step is in the gap

    def step_ended(self) -> None:
        """A step's work is done (the engine's end of backward, the loop's end of a step)."""
        if self.started is not None:
            self.last_end = time.time()
            self._at_end[:] = PROGRESS.clock.totals

    # ------------------------------------------------------------------ work thrown away

    def point(self) -> Point:
        """Now, and the seconds lost so far: the start of work that a loss may discard."""
        return Point(time.time(), self._lost_total())

    def discard(self, since: Point) -> None:
        """The work since `since` is thrown away (a member was lost in it, or the run went back to its
        mark): its training time is redone work, the collective that failed at its end hang detection."""
        if self.started is None:
            return
        now = time.time()
        # The work's own time: what its lost phases (an evaluation, a save) took is theirs already
        span = max(0.0, (now - since.wall) - (self._lost_total() - since.lost))
        detection = 0.0
        if PROGRESS.waiting is not None and PROGRESS.wait_since >= since.wall:
            detection = min(span, max(0.0, now - PROGRESS.wait_since))
        self.carried[HANG_DETECTION] += detection
        self.carried[REDONE_WORK] += span - detection
        self.redos += 1
        self.step_ended()  # the wall time runs to here at least: what was discarded lies inside it

    def restarted_from_scratch(self, started: float) -> None:
        """A restart with no checkpoint to carry the account from: the run began at `started` (the crashed
        attempts' first step), and everything until this attempt's first step is lost to the restart."""
        if self.started is None:
            self.started = started
            self._arrival = (RESTART, started)

    def lose_samples(self, samples: int) -> None:
        """Samples of counted steps that were undone (a restart from an earlier checkpoint)."""
        self.samples_lost += max(0, samples)

    # ------------------------------------------------------------------ the account as state

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds and a replacement receives: the account as of now."""
        return {
            "format": FORMAT,
            "started": self.started,
            "lost": self.lost_by_cause(),
            "samples_lost": self.samples_lost,
            "redos": self.redos,
            "between_jobs_s": self.between_jobs_s,
            "at": time.time(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Carry on from a checkpoint's account or a peer's: how it arrives (`arriving`, set by the run
        before it loads) decides where the gap until this process's first step goes."""
        if not state or state.get("format") != FORMAT or state.get("started") is None:
            return  # an older checkpoint, or a run that had not stepped: this account starts afresh
        self.started = float(state["started"])
        self.carried = {cause: float(state["lost"].get(cause, 0.0)) for cause in CAUSES}
        self.samples_lost = int(state["samples_lost"])
        self.redos = int(state["redos"])
        self.between_jobs_s = float(state["between_jobs_s"])
        self.last_end = None
        self._zero[:] = PROGRESS.clock.totals
        if self.arriving == "transfer":
            # a replacement: from rank 0's snapshot to here the state was on its way; its joining phase
            # after this is counted as it goes
            self.carried[STATE_TRANSFER_CAUSE] += max(0.0, time.time() - float(state["at"]))
            self._arrival = None
        else:
            self._arrival = (RESTART if self.arriving == "restart" else "between jobs", float(state["at"]))

    # ------------------------------------------------------------------ reading it

    def lost_by_cause(self, totals: array | None = None) -> dict[str, float]:
        """Seconds lost by cause: what was carried, and the lost phases since this account began (up to
        `totals`, the clock's; now when None, the current phase's running time included)."""
        lost = dict(self.carried)
        if self.started is None:
            return lost
        clock = PROGRESS.clock
        for phase, cause in CAUSE_OF_PHASE.items():
            slot = clock._slots.get(phase)
            if slot is None:
                continue
            upto = (totals or clock.totals)[slot]
            if totals is None and clock._cur == slot:
                upto += time.perf_counter() - clock._since
            lost[cause] += max(0.0, upto - self._zero[slot])
        return lost

    def summary(self, *, upto_now: bool = False) -> dict[str, Any]:
        """summary.json's goodput keys: `goodput` (the steps that counted over the wall time from the
        first step to the last), `lost_s_by_cause`, `samples_lost`, and the figures behind them."""
        end = time.time() if upto_now or self.last_end is None else self.last_end
        if self.started is None:
            return {"goodput": None, "lost_s_by_cause": dict.fromkeys(CAUSES, 0.0), "samples_lost": 0}
        lost = self.lost_by_cause(None if upto_now or self.last_end is None else self._at_end)
        wall = max(0.0, end - self.started - self.between_jobs_s)
        training = max(0.0, wall - sum(lost.values()))
        summary: dict[str, Any] = {
            "goodput": round(training / wall, 4) if wall > 0 else None,
            "lost_s_by_cause": {cause: round(seconds, 3) for cause, seconds in lost.items()},
            "samples_lost": self.samples_lost,
            "redos": self.redos,
            "training_s": round(training, 3),
            "goodput_wall_s": round(wall, 3),
        }
        if self.between_jobs_s:
            summary["between_jobs_s"] = round(self.between_jobs_s, 3)
        return summary

    def _lost_total(self) -> float:
        return sum(self.lost_by_cause().values())


def describe(summary: dict[str, Any]) -> str:
    """'goodput 0.973 (lost 1.2 s reformation, 0.4 s redone_work)': the causes that cost anything."""
    lost = sorted(((s, c) for c, s in summary["lost_s_by_cause"].items() if s >= 0.05), reverse=True)
    causes = ", ".join(f"{seconds:.1f} s {cause}" for seconds, cause in lost)
    words = f"goodput {summary['goodput']:.3f}" + (f" (lost {causes})" if causes else "")
    return words + (f", {summary['samples_lost']} samples lost" if summary.get("samples_lost") else "")


def restart_attempt(env: os._Environ[str] | dict[str, str] | None = None) -> int:
    """Which attempt of its job this process belongs to (0: the first): lockstep's live launcher, torch's
    elastic agent (--max-restarts) or a SLURM requeue say so in the environment."""
    from lockstep.runtime.env.env_contract import ATTEMPT_VAR, RESTART_COUNT_VAR

    env = os.environ if env is None else env
    counts = [env.get(ATTEMPT_VAR, ""), env.get(RESTART_COUNT_VAR, ""), env.get("SLURM_RESTART_COUNT", "")]
    return max((int(c) for c in counts if c.strip().isdigit()), default=0)


ACCOUNT = RunAccount()
PROGRESS.account = ACCOUNT  # Progress tells it of every step (progress.py cannot import this module)
for _name in CAUSE_OF_PHASE:  # their clock slots from the start: never shared with a program's own phases
    PROGRESS.clock.slot(_name)


def goodput() -> dict[str, Any]:
    """This process's account of the run so far: `goodput` (the time of the steps that counted over the wall
    time from the first step to the last), `lost_s_by_cause` (seconds), `samples_lost`, and the figures
    behind them. `lockstep.fit` puts it in summary.json; a loop of your own (LiveLoop, or the engine alone)
    reads it here, on any rank, at its end.

        print(lockstep.goodput())  # {'goodput': 0.981, 'lost_s_by_cause': {...}, 'samples_lost': 0, ...}
    """
    return ACCOUNT.summary()
