"""fit's side of live mode: a part of `FitRun`, chosen once per run, and what runtime/membership/recovery.py
asks of it (its Recoverable).

`side_of_run` makes the choice, once: `NotLive` outside live mode, `FitLive` in it (`FitLiveRounds` for a
low-communication run, whose rounds count on every member or on none). `FitRun` (trainer/loop.py) holds
the one it gets and asks it, without knowing which it holds:

- while the run is built: the batch cut (`batch_plan`: live mode cuts every step into micro-batches), this
  rank's place after the start-up (`topology`), the optimizer's shards (`sharded`: two copies of each in
  live mode), how a micro-batched step's metric rows are kept (`commit_step`: in live mode the step counts
  on every member or on none, its rows on the store), and the step driver through which the start-up's
  collectives, every step and every collective work between steps run (`driver`,
  trainer/run/step_driver.py);
- once the run's parts exist (`attach`): a replacement receives its state (`receive_state`), replacements
  join after a step (`after_step`), logged rows are forgotten (`logged`), and a low-communication run
  counts its rounds (`mark_round`, `after_step`, `end_of_epoch`, `rolled_back`, `close`).

`FitLive` is the run's `Recoverable`: live recovery reaches the run only through its few methods (release
and rebuild the replica, progress marks, state_dict, reshard, take over rank 0's duties). It holds the
parts of the run it works on: the replica (trainer/run/replica.py), the run's state and its registry
(trainer/run/run_state.py, trainer/run/registry.py), what is cut over the ranks (the training data and the
evaluation), and rank 0's metric log and progress bar, which a process that becomes rank 0 takes over.
`FitLiveRounds` goes back to its round's start on a loss (trainer/live/live_rounds.py): `discard_step`
arms that, `rebuild_replica` does it on the new replica; a streaming DiLoCo run goes back to its last
fragment's sync, and the fault's record says what it dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch

from lockstep.engine.core.sync_algorithms import parse_sync
from lockstep.engine.sharded import ShardHandle
from lockstep.engine.sharded.rebuild import move_optimizer
from lockstep.plan import Plan
from lockstep.runtime.env.topology import Topology
from lockstep.runtime.membership.group import LiveGroup
from lockstep.runtime.membership.records import Fault
from lockstep.runtime.membership.recovery import LiveRecovery, StartUpRecovery
from lockstep.runtime.process_group import live_group
from lockstep.trainer.live.live_agreed import agreed_between_steps
from lockstep.trainer.live.live_rounds import LiveRounds
from lockstep.trainer.live.live_shards import share_shards
from lockstep.trainer.live.live_takeover import describe_change, take_over_log, take_over_rows
from lockstep.trainer.reporting.metrics import OrderedMetrics, TrainMetrics
from lockstep.trainer.reporting.progress import ProgressBar
from lockstep.trainer.reporting.run_log import RunLog
from lockstep.trainer.run.batches import BatchPlan, BatchSettings, micro_batch_cut, plan_batches
from lockstep.trainer.run.optim import maybe_sharded
from lockstep.trainer.run.registry import Use
from lockstep.trainer.run.replica import FitReplica
from lockstep.trainer.run.run_state import RunState
from lockstep.trainer.run.step_driver import StepDriver
from lockstep.trainer.settings.config import FitConfig, plan_of

T = TypeVar("T")


class Sharded(Protocol):
    """What is cut over the ranks, and cut again for a new group (data, evaluation, the checkpoints' group)."""

    def reshard(self, topology: Topology) -> None: ...


def side_of_run(config: FitConfig, topology: Topology) -> NotLive | FitLive:
    """Live mode or not, chosen once for the run (see the module doc); `topology`: this rank's as launched."""
    group = live_group()
    if group is None:
        return NotLive(topology)
    if config.shard_degree > 1:  # a rank lost takes its replica group's copy of the model with it
        group.hold_in_groups(config.shard_degree)
    if parse_sync(config.sync) is None:
        return FitLive(group)
    return FitLiveRounds(group, config)


def live_batch_plan(config: BatchSettings, world_size: int, launched: int) -> BatchPlan:
    """Live mode's cut of a step: into micro-batches, as deterministic mode does, so that a step lost with a
    rank is redone over the survivors with the same samples; the global batch defaults to the per-rank
    batch on every one of the `launched` ranks (the run's plan refused a cut that leaves one of them
    without a micro-batch: lockstep/plan.py, VALUE_CHECKS)."""
    if config.deterministic:
        return plan_batches(config, world_size)
    total = config.global_batch_size
    if total is None:
        total = config.batch_size * config.grad_accum_steps * launched
    return micro_batch_cut(config, total)


class NotLive:
    """FitRun outside live mode: nothing to receive, to admit or to go back to; a failure is the program's."""

    live = False
    regroups = False  # the group never changes under the run
    restarts = None  # summary.json's `restarts`: live mode's count of whole-job restarts
    joining = False  # a replacement that receives its state from a peer (live mode)

    def __init__(self, topology: Topology) -> None:
        self.launched = topology
        self.driver = StepDriver()

    @property
    def member_id(self) -> int:
        """This process in the run's timeline: its launch rank."""
        return self.launched.rank

    def plan(self, config: FitConfig, world_size: int) -> Plan:
        """The run's plan, built once (fit's door)."""
        return plan_of(config, world_size, live=False)

    def batch_plan(self, config: FitConfig, world_size: int) -> BatchPlan:
        return plan_batches(config, world_size)

    def topology(self) -> Topology:
        return self.launched

    def sharded(self, optimizer: torch.optim.Optimizer, config: FitConfig) -> Any:
        return maybe_sharded(optimizer, config)

    def attach(
        self,
        *,
        replica: FitReplica,
        state: RunState,
        shards: Sequence[Sharded],
        output: tuple[RunLog, ProgressBar],
    ) -> None:
        pass

    def agreed(self, work: Callable[[], T]) -> Callable[[], T]:
        """Work between steps, as it is: nothing can leave some ranks behind."""
        return work

    def commit_step(self, step: int, rows: OrderedMetrics, metrics: TrainMetrics) -> None:
        """A micro-batched step's rows join the pending ones."""
        metrics.pending.merge(rows)  # type: ignore[union-attr]  # micro-batched: OrderedMetrics

    def logged(self, metrics: TrainMetrics) -> None:
        pass

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

    replica: FitReplica
    state: RunState
    shards: Sequence[Sharded]
    runlog: RunLog
    bar: ProgressBar
    recovery: LiveRecovery[Topology]

    live = True
    regroups = True  # members leave and join: a sharded replica is cut anew over each new group

    def __init__(self, group: LiveGroup[Topology]) -> None:
        self.group = group
        self.restarts = group.attempt  # whole-job restarts before this one (summary.json's `restarts`)
        # Until the run's parts exist, a member lost in the start-up's collectives is survived like any other.
        self.driver = StepDriver(StartUpRecovery(group))

    # ---- while the run is built -------------------------------------------------------------------------------

    @property
    def joining(self) -> bool:
        """A replacement, which receives the run's state from a peer (until it did)."""
        return self.group.needs_state

    @property
    def member_id(self) -> int:
        """This process in the run's timeline: its member id (a replacement's comes after the launched ones)."""
        return self.group.membership.member_id

    def plan(self, config: FitConfig, world_size: int) -> Plan:
        """The run's plan, built once (fit's door): on the launched ranks, which each need a micro-batch of
        every step whatever the survivors."""
        return plan_of(config, self.group.launch_world_size, live=True, min_world=self.group.min_world)

    def batch_plan(self, config: FitConfig, world_size: int) -> BatchPlan:
        return live_batch_plan(config, world_size, self.group.launch_world_size)

    def topology(self) -> Topology:
        """This rank's place after the start-up (members may have been lost meanwhile)."""
        return self.group.topology()

    def sharded(self, optimizer: torch.optim.Optimizer, config: FitConfig) -> Any:
        """Each share kept by two ranks; the all-gather waits until the step counted (`gather()` after it)."""
        return maybe_sharded(optimizer, config, copies=2, defer_gather=True)

    def attach(
        self,
        *,
        replica: FitReplica,
        state: RunState,
        shards: Sequence[Sharded],
        output: tuple[RunLog, ProgressBar],
    ) -> None:
        """The run's parts exist: from now on a loss recovers the run."""
        self.replica, self.state, self.shards = replica, state, shards
        self.runlog, self.bar = output
        self.recovery = LiveRecovery(self.group, self)
        self.driver = StepDriver(self.recovery, self.rollback())
        state.record.faults = self.recovery.startup_faults()

    def rollback(self) -> LiveRounds | None:
        """What a loss takes the run back to instead of redoing the step: nothing (FitLiveRounds: a round mark)."""
        return None

    def agreed(self, work: Callable[[], T]) -> Callable[[], T]:
        """Work between steps that counts on every member or on none (live_agreed.py)."""
        return agreed_between_steps(self.group, lambda: self.state.counters.step, work)

    def commit_step(self, step: int, rows: OrderedMetrics, metrics: TrainMetrics) -> None:
        """The step counts on every member or on none; its rows go with it to the store, where the survivors
        find them if this rank is lost before the next log."""
        packed = rows.packed()
        self.group.commit(step, packed)
        metrics.unlogged.append((step, self.group.membership.generation))
        metrics.pending.add_packed(packed, metrics.names("train"))  # type: ignore[union-attr]  # OrderedMetrics

    def logged(self, metrics: TrainMetrics) -> None:
        """The rows since the last log are logged: a later loss need not recover them."""
        self.group.forget_rows(metrics.unlogged)
        metrics.unlogged = []

    # ---- what the loop calls ----------------------------------------------------------------------------------

    def receive_state(self) -> bool:
        """A replacement: the state comes from a peer, not a checkpoint. True when it did."""
        if not self.group.needs_state:
            return False
        self.recovery.receive_state()
        return True

    def mark_round(self) -> None:
        pass

    def after_step(self, *, synced: bool, more: bool) -> bool:
        """After a step and its work: replacements join. True when the group changed (the loop re-cuts its
        iteration)."""
        step = self.state.counters.step
        return self.driver.changed_by(lambda: self.recovery.admit_joiners(step))

    def end_of_epoch(self, *, synced: bool) -> None:
        pass

    def rolled_back(self) -> None:
        pass

    def close(self) -> None:
        pass

    # ---- the Recoverable (runtime/membership/recovery.py) ---------------------------------------------------

    @property
    def faults(self) -> list[dict[str, Any]]:
        return self.state.record.faults

    def release_replica(self) -> None:
        self.state.set_aside()
        self.replica.release()

    def rebuild_replica(self, topology: Topology) -> None:
        old = self.replica.rebuild(topology)
        if old is not None:  # a sharded model cut anew: the optimizer and the run's entries move onto it
            move_optimizer(cast(torch.optim.Optimizer, self.state.optimizer), old, self.replica.module)
            self.state.use_module(self.replica.module)

    def share_shards(self, holders: list[int]) -> None:
        """A sharded run: a replacement group receives its shards from the live groups (live_shards.py)."""
        handle = self.replica.handle
        if isinstance(handle, ShardHandle):
            optimizer = cast(torch.optim.Optimizer, self.state.optimizer)
            share_shards(handle, optimizer, holders, joining=self.group.needs_state)

    def discard_step(self) -> None:
        self.state.optimizer.zero_grad(set_to_none=True)

    def marks(self) -> dict[str, Any]:
        return self.state.marks()

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
        step = self.state.counters.step
        if self.replica.topo.rank == 0:
            take_over_rows(self.group, self.state.metrics, fault.lost)
            if not self.runlog.enabled:  # this rank became rank 0 (the old one was lost)
                take_over_log(self.runlog, self.bar, step)
        self.bar.message(describe_change(fault, step))


class FitLiveRounds(FitLive):
    """A low-communication run (FitConfig.sync) in live mode: a round counts on every member or on none
    (trainer/live/live_rounds.py); replacements join at a round's end."""

    rounds: LiveRounds

    def __init__(self, group: LiveGroup[Topology], config: FitConfig) -> None:
        super().__init__(group)
        algorithm = parse_sync(config.sync)
        self.sync_every = config.sync_every
        self.fragments = config.fragments if algorithm is not None and algorithm.delayed else None

    def rollback(self) -> LiveRounds:
        self.rounds = LiveRounds(self.group, self.state, self.sync_every, fragments=self.fragments)
        return self.rounds

    def mark_round(self) -> None:
        """Keep this rank's state as where a lost member's round is redone from."""
        self.rounds.mark(len(self.runlog.records) if self.runlog.enabled else None)

    def after_step(self, *, synced: bool, more: bool) -> bool:
        """At a round's end, after the step whose outer sync ended it, unless the epoch ends with it
        (end_of_epoch): the round counts, then replacements join. True when the group changed."""
        return synced and more and self._end_round()

    def end_of_epoch(self, *, synced: bool) -> None:
        """After the epoch's end (its checkpoint, its evaluation): a round that ended with the epoch's last step."""
        if synced:
            self._end_round()

    def rolled_back(self) -> None:
        """The run went back to its round's start: the metric log as it was there."""
        self.rounds.rewind_log(self.runlog)

    def close(self) -> None:
        """The summary is published: a loss in the last barrier goes back nowhere."""
        self.rounds.closed = True

    def _end_round(self) -> bool:
        """After the step whose outer sync ended a round (and its logs, evaluation, checkpoint, the epoch's
        end): the round counts on every member or on none (a loss: RolledBack, step_driver.py), a new mark,
        then the replacements join. True when the group grew."""
        rounds, handle, step = self.rounds, self.replica.handle, self.state.counters.step
        if handle is None:
            return False
        self.driver.run(lambda: rounds.settle(handle, step))  # streaming: before a growth
        self.driver.run(lambda: rounds.commit(step))
        self.mark_round()
        if not rounds.round_end(step):  # streaming: a fragment's sync inside the round
            return False
        # A member lost while the group grows takes everyone back to this mark: where they stand anyway.
        return self.driver.changed_by(
            lambda: self.recovery.admit_joiners(step, next_step=step + rounds.sync_every)
        )

    def rebuild_replica(self, topology: Topology) -> None:
        super().rebuild_replica(topology)  # the outer state moves to the new handle
        self.rounds.rebuilt()  # after a loss: back to the round's start (after the replica's broadcast)

    def discard_step(self) -> None:
        super().discard_step()
        self.rounds.discard()

    def marks(self) -> dict[str, Any]:
        marks = super().marks()
        # A periodic run's metrics are this rank's own sums (unequal counts across ranks); a loss takes every
        # member back to the same mark, so they cannot disagree on what was logged.
        marks.pop("pending_metrics")
        return marks

    def regrouped(self, fault: Fault) -> None:
        record = self.state.record
        if self.rounds.dropped is not None and record.faults:
            record.faults[-1]["dropped"] = self.rounds.dropped  # streaming: what the rollback dropped
            self.rounds.dropped = None
        super().regrouped(fault)
