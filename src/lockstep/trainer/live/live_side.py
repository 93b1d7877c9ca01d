"""fit's side of live mode: a part of `FitRun`, what runtime/membership/recovery.py asks of it (its Recoverable).

`FitRun` (trainer/loop.py) holds one of two objects behind one small interface, chosen once: `FitLive` in
live mode, `NotLive` otherwise. Through it the loop runs its steps and its collective work (`driver`,
trainer/run/step_driver.py), a replacement receives its state (`receive_state`), replacements join after a
step (`after_step`), and a low-communication run counts its rounds (`mark_round`, `after_step`,
`end_of_epoch`, `rolled_back`, `close`).

`FitLive` is the run's `Recoverable`: live recovery reaches the run only through its few methods (release
and rebuild the replica, progress marks, state_dict, reshard, take over rank 0's duties). It holds the
parts of the run it works on: the replica (trainer/run/replica.py), the run's state and its registry
(trainer/run/run_state.py, trainer/run/registry.py), what is cut over the ranks (the training data and the
evaluation), and rank 0's metric log and progress bar, which a process that becomes rank 0 takes over. A
low-communication run (FitConfig.sync) goes back to its round's start on a loss (trainer/live/live_rounds.py):
`discard_step` arms that, `rebuild_replica` does it on the new replica; a streaming DiLoCo run goes back
to its last fragment's sync, and the fault's record says what it dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from lockstep.runtime.env.topology import Topology
from lockstep.runtime.membership.group import LiveGroup
from lockstep.runtime.membership.records import Fault
from lockstep.runtime.membership.recovery import LiveRecovery
from lockstep.trainer.live.live_rounds import LiveRounds
from lockstep.trainer.live.live_takeover import describe_change, take_over_log, take_over_rows
from lockstep.trainer.reporting.progress import ProgressBar
from lockstep.trainer.reporting.run_log import RunLog
from lockstep.trainer.run.registry import Use
from lockstep.trainer.run.replica import FitReplica
from lockstep.trainer.run.run_state import RunState
from lockstep.trainer.run.step_driver import StepDriver
from lockstep.trainer.settings.config import FitConfig


class Sharded(Protocol):
    """What is cut over the ranks, and cut again for a new group (the training data, the evaluation)."""

    def reshard(self, topology: Topology) -> None: ...


class NotLive:
    """FitRun outside live mode: nothing to receive, to admit or to go back to; a failure is the program's."""

    def __init__(self) -> None:
        self.driver = StepDriver(None)

    def receive_state(self) -> bool:
        return False

    def mark_round(self) -> None:
        pass

    def after_step(self, *, synced: bool, more: bool) -> bool:
        return False

    def end_of_epoch(self, *, synced: bool) -> None:
        pass

    def rolled_back(self) -> None:
        pass

    def close(self) -> None:
        pass


class FitLive:
    """FitRun's side of live mode (see the module doc)."""

    def __init__(
        self,
        group: LiveGroup,
        config: FitConfig,
        *,
        replica: FitReplica,
        state: RunState,
        shards: Sequence[Sharded],
        output: tuple[RunLog, ProgressBar],
    ) -> None:
        self.group, self.replica, self.state, self.shards = group, replica, state, shards
        self.runlog, self.bar = output
        # a low-communication run: a round counts on every member or on none (live_rounds.py)
        self.rounds = LiveRounds.of_run(group, state, config)
        self.recovery = LiveRecovery(group, self)
        self.driver = StepDriver(self.recovery, self.rounds)
        state.record.faults = self.recovery.startup_faults()

    # ---- what the loop calls ----------------------------------------------------------------------------------

    def receive_state(self) -> bool:
        """A replacement: the state comes from a peer, not a checkpoint. True when it did."""
        if not self.group.needs_state:
            return False
        self.recovery.receive_state()
        return True

    def mark_round(self) -> None:
        """A low-communication run: keep this rank's state as where a lost member's round is redone from."""
        if self.rounds is not None:
            self.rounds.mark(len(self.runlog.records) if self.runlog.enabled else None)

    def after_step(self, *, synced: bool, more: bool) -> bool:
        """After a step and its work: replacements join (a low-communication run: at a round's end, after
        the step whose outer sync ended it, unless the epoch ends with it: end_of_epoch). True when the
        group changed (the loop re-cuts its iteration)."""
        if self.rounds is None:
            return self.recovery.admit_joiners(self.state.counters.step)
        return synced and more and self._end_round(self.rounds)

    def end_of_epoch(self, *, synced: bool) -> None:
        """After the epoch's end (its checkpoint, its evaluation): a round that ended with the epoch's last step."""
        if self.rounds is not None and synced:
            self._end_round(self.rounds)

    def rolled_back(self) -> None:
        """The run went back to its round's start: the metric log as it was there."""
        if self.rounds is not None:
            self.rounds.rewind_log(self.runlog)

    def close(self) -> None:
        """The summary is published: a loss in the last barrier goes back nowhere."""
        if self.rounds is not None:
            self.rounds.closed = True

    def _end_round(self, rounds: LiveRounds) -> bool:
        """After the step whose outer sync ended a round (and its logs, evaluation, checkpoint, the epoch's
        end): the round counts on every member or on none (a loss: RolledBack, step_driver.py), a new mark,
        then the replacements join. True when the group grew."""
        handle, step = self.replica.handle, self.state.counters.step
        if handle is None:
            return False
        self.driver.run(lambda: rounds.settle(handle, step))  # streaming: before a growth
        self.driver.run(lambda: rounds.commit(step))
        self.mark_round()
        if not rounds.round_end(step):  # streaming: a fragment's sync inside the round
            return False
        # A member lost while the group grows takes everyone back to this mark: where they stand anyway.
        return self.recovery.admit_joiners(step, next_step=step + rounds.sync_every)

    # ---- the Recoverable (runtime/membership/recovery.py) ---------------------------------------------------

    @property
    def faults(self) -> list[dict[str, Any]]:
        return self.state.record.faults

    def release_replica(self) -> None:
        self.state.set_aside()
        self.replica.release()

    def rebuild_replica(self, topology: Topology) -> None:
        self.replica.rebuild(topology)  # a low-communication run's outer state moves to the new handle
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
        for shard in self.shards:
            shard.reshard(topology)

    def regrouped(self, fault: Fault) -> None:
        record, step = self.state.record, self.state.counters.step
        if self.rounds is not None and self.rounds.dropped is not None and record.faults:
            record.faults[-1]["dropped"] = self.rounds.dropped  # streaming: what the rollback dropped
            self.rounds.dropped = None
        if self.replica.topo.rank == 0:
            take_over_rows(self.group, self.state.metrics, fault.lost)
            if not self.runlog.enabled:  # this rank became rank 0 (the old one was lost)
                take_over_log(self.runlog, self.bar, step)
        self.bar.message(describe_change(fault, step))
