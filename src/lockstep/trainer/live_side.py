"""fit's side of live mode: what runtime/membership/recovery.py asks of a `FitRun` (its Recoverable).

`LiveSide` is a mixin of FitRun (trainer/loop.py): the few methods through which live recovery reaches
the run (release and rebuild the replica, progress marks, state_dict, reshard, take over rank 0's
duties). A low-communication run (FitConfig.sync) goes back to its round's start on a loss
(trainer/live_rounds.py): `discard_step` arms that, `rebuild_replica` does it on the new replica; a
streaming DiLoCo run goes back to its last fragment's sync, and the fault's record says what it dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from lockstep.engine import ReplicaHandle, replicate
from lockstep.runtime.membership.group import LiveGroup
from lockstep.runtime.membership.records import Fault
from lockstep.runtime.membership.recovery import LiveRecovery
from lockstep.runtime.topology import Topology
from lockstep.trainer.buckets import fit_policy
from lockstep.trainer.config import FitConfig
from lockstep.trainer.evaluation import Evaluation
from lockstep.trainer.live_rounds import LiveRounds
from lockstep.trainer.live_takeover import describe_change, take_over_log, take_over_rows
from lockstep.trainer.low_comm import PeriodicRun
from lockstep.trainer.progress import ProgressBar
from lockstep.trainer.registry import Use
from lockstep.trainer.run_log import RunLog
from lockstep.trainer.run_state import RunRecord, RunState, TrainCounters
from lockstep.trainer.step_driver import StepDriver
from lockstep.trainer.steps import Stepper
from lockstep.trainer.train_data import TrainData


class LiveSide:
    """FitRun's side of live mode (see the module doc)."""

    config: FitConfig
    live: LiveGroup | None
    module: nn.Module
    handle: ReplicaHandle | None
    topo: Topology
    state: RunState
    record: RunRecord
    counters: TrainCounters
    data: TrainData
    evaluation: Evaluation
    runlog: RunLog
    bar: ProgressBar
    run_dir: Path
    total_steps: int
    stepper: Stepper
    periodic_run: PeriodicRun | None
    rounds: LiveRounds | None

    recovery: LiveRecovery | None
    driver: StepDriver

    # ---- a low-communication run's rounds (live_rounds.py), called by the loop ------------------------------

    def mark_round(self) -> None:
        """Keep this rank's state as where a lost member's round is redone from."""
        if self.rounds is not None:
            self.rounds.mark(len(self.runlog.records) if self.runlog.enabled else None)

    def end_round(self) -> bool:
        """After the step whose outer sync ended a round (and its logs, evaluation, checkpoint, the epoch's
        end): the round counts on every member or on none (a loss: RolledBack, step_driver.py), a new mark, then the
        replacements join. True when the group grew."""
        rounds, recovery, handle = self.rounds, self.recovery, self.handle
        if rounds is None or recovery is None or handle is None:
            return False
        step = self.counters.step
        self.driver.run(lambda: rounds.settle(handle, step))  # streaming: before a growth
        self.driver.run(lambda: rounds.commit(step))
        self.mark_round()
        if not rounds.round_end(step):  # streaming: a fragment's sync inside the round
            return False
        # A member lost while the group grows takes everyone back to this mark: where they stand anyway.
        return recovery.admit_joiners(step, next_step=step + self.config.sync_every)

    # ---- the Recoverable (runtime/membership/recovery.py) ---------------------------------------------------

    @property
    def faults(self) -> list[dict[str, Any]]:
        return self.record.faults

    def release_replica(self) -> None:
        self.state.set_aside()
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def rebuild_replica(self, topology: Topology) -> None:
        self.topo = topology
        self.handle = replicate(self.module, policy=fit_policy(self.config, live=self.live is not None))
        if self.periodic_run is not None:  # the outer state moves to the new handle
            self.periodic_run.rebind(self.handle)
            self.stepper.outer = self.handle
        if self.rounds is not None:  # after a loss: back to the round's start (after the replica's broadcast)
            self.rounds.rebuilt()

    def discard_step(self) -> None:
        self.state.optimizer.zero_grad(set_to_none=True)
        if self.rounds is not None:
            self.rounds.discard()

    def marks(self) -> dict[str, Any]:
        marks = self.state.marks()
        if self.rounds is not None:
            # A periodic run's metrics are this rank's own sums (unequal counts across ranks); a loss takes
            # every member back to the same mark, so they cannot disagree on what was logged.
            marks.pop("pending_metrics")
        return marks

    def reconcile(self, mark: str) -> None:
        self.state.reconcile(mark)

    def state_dict(self) -> dict[str, Any]:
        return self.state.registry.snapshot(Use.TRANSFER)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.registry.restore(state, Use.TRANSFER)

    def reshard(self, topology: Topology) -> None:
        self.state.regroup()
        self.data.reshard(topology)
        self.evaluation.reshard(topology)

    def regrouped(self, fault: Fault) -> None:
        if self.rounds is not None and self.rounds.dropped is not None and self.record.faults:
            self.record.faults[-1]["dropped"] = self.rounds.dropped  # streaming: what the rollback dropped
            self.rounds.dropped = None
        if self.topo.rank == 0 and self.live is not None:
            take_over_rows(self.live, self.state.metrics, fault.lost)
            if not self.runlog.enabled:  # this rank became rank 0 (the old one was lost)
                self.runlog, self.bar = take_over_log(
                    self.run_dir, self.total_steps, self.config, self.counters.step
                )
        self.bar.message(describe_change(fault, self.counters.step))
