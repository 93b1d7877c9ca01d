"""fit's loop: the phases of one run (resume, epochs, steps, logs, evaluation, checkpoints, the end).

Every collective in here runs on every rank at the same point: the metric reduction on log steps, the
evaluation reduction, and the checkpoint save. Progress and logging only print on rank 0 and never
communicate, so no rank can be left waiting in a collective that rank 0 alone entered.

The run's parts: the replica (replica.py), its state, each entry registered once (run_state.py), the
steps (steps.py), evaluation (evaluation.py), metrics (metrics.py), the summary (summary.py), and its
side: live mode or not, chosen once (trainer/live/live_side.py, `side_of_run`). The loop asks the side
without knowing which it holds; through the side's driver the replica's start-up, every step and every
collective work between steps run (step_driver.py: DONE, REDO, ROLLED_BACK). In live mode the side is the
run's `Recoverable` (runtime/membership/recovery.py); a low-communication run there counts its rounds on
every member or on none, and goes back to a round's start when a member is lost (live_rounds.py): the
loop then carries on from there (`RolledBack`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sized
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep.checkpoint import CheckpointManager
from lockstep.engine.core.sync_algorithms import parse_sync
from lockstep.engine.syncbn import convert_sync_batchnorm
from lockstep.errors import ConfigError, InternalError
from lockstep.plan import Reduction
from lockstep.runtime import barrier, broadcast_object
from lockstep.runtime.env.topology import Topology
from lockstep.runtime.progress import DATA, PROGRESS
from lockstep.runtime.run_account import ACCOUNT
from lockstep.trainer.live.live_side import side_of_run
from lockstep.trainer.reporting.metrics import TrainMetrics
from lockstep.trainer.reporting.progress import ProgressBar
from lockstep.trainer.reporting.run_log import RunLog
from lockstep.trainer.reporting.run_records import RunRecords
from lockstep.trainer.run.buckets import bucket_summary, tunes_buckets
from lockstep.trainer.run.device import choose_device
from lockstep.trainer.run.evaluation import Evaluation
from lockstep.trainer.run.low_comm import PeriodicRun
from lockstep.trainer.run.optim import build_optimizer, build_scheduler
from lockstep.trainer.run.replica import FitReplica
from lockstep.trainer.run.run_state import RunState
from lockstep.trainer.run.step_driver import Outcome, RolledBack
from lockstep.trainer.run.steps import LossFn, Stepper, stepped_optimizer
from lockstep.trainer.run.train_data import TrainData
from lockstep.trainer.settings.config import FitConfig
from lockstep.trainer.summary import (
    build_summary,
    checkpoint_summary,
    comm_bytes_since,
    comm_bytes_so_far,
    publish_summary,
    straggler_summary,
)


class FitRun:
    """One call of fit(): the objects it builds and the phases of the loop."""

    def __init__(
        self,
        model: nn.Module,
        train_data: Dataset,
        eval_data: Dataset | None,
        loss_fn: LossFn,
        config: FitConfig,
        topo: Topology,
        make_optimizer: Callable[[Any], torch.optim.Optimizer] | None,
    ) -> None:
        self.config = config
        self.device = choose_device(config.device)
        torch.manual_seed(config.seed + topo.rank)  # per-rank streams for dropout/augmentation
        module = (convert_sync_batchnorm(model) if config.sync_batchnorm else model).to(self.device)
        self.side = side_of_run(config, topo)  # live mode or not, chosen once (live_side.py)
        # Which settings combine and the engine's mode: the plan's (lockstep/plan.py; `lockstep train` checked
        # it before launch, a program of your own meets its refusal here), built once and handed down
        self.modes = self.side.plan(config, topo.world_size)
        # The step's cut (live mode cuts every step into micro-batches, as deterministic mode does)
        self.plan = self.side.batch_plan(config, topo.world_size)
        self.periodic = self.modes.reduction is Reduction.PERIODIC  # local steps, outer syncs
        # a step: K micro-batches through accumulate() (the periodic modes step each rank's alone)
        self.micro_batched = self.plan.num_micro_batches > 0 and not self.periodic
        self.run_dir = Path(config.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir, keep=config.keep_checkpoints)
        # the time account and every rank's timeline, once the plan holds (trainer/reporting/run_records.py)
        self.records = RunRecords(self.run_dir, self.side, topo.rank, self.checkpoints)
        # The replica's model (live mode cuts a sharded one anew over a new group): the module itself under
        # accumulate() (deterministic and live mode), stepping alone (sync: every sync_every steps) or with
        # its bucket size tuned (bucket_cap_mb="auto": the drop-in face keeps torch's), else torch's face.
        in_place = self.micro_batched or self.periodic or tunes_buckets(config)
        self.replica = FitReplica(module, config, self.device, self.side, in_place=in_place)
        handle = self.replica.handle
        self.data = TrainData(
            train_data, config, self.plan, self.replica.topo, pin=self.device.type == "cuda"
        )
        self.sampler = self.data.sampler
        metrics = TrainMetrics(config.task, ordered=self.micro_batched)
        self.evaluation = Evaluation(eval_data, config, metrics, loss_fn, self.device)
        self.evaluation.reshard(self.replica.topo)
        if self.data.steps_in_epoch() == 0:
            raise ConfigError(
                f"the training set of {len(cast(Sized, train_data))} samples gives no full step of "
                f"{self.plan.global_batch_size} samples on {topo.world_size} ranks; lower batch_size (or "
                "global_batch_size) or use fewer processes"
            )
        self.total_steps = config.epochs * self.data.steps_in_epoch()
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        optimizer = (make_optimizer or (lambda p: build_optimizer(p, config)))(module.parameters())
        self.state = RunState(
            module,
            self.side.sharded(optimizer, config),
            build_scheduler(optimizer, config, self.total_steps),
            torch.amp.GradScaler(self.device.type, enabled=config.precision == "fp16"),
            self.sampler,
            metrics,
        )
        self.counters, self.record = self.state.counters, self.state.record
        main = self.replica.topo.is_main
        self.runlog = RunLog(self.run_dir, enabled=main)
        self.bar = ProgressBar(self.total_steps, enabled=main, mode=config.progress)
        self.stepper = Stepper(
            self.state,
            config,
            self.plan,
            loss_fn,
            self.device,
            # overlap_optimizer: the engine steps the buckets
            optimizer=stepped_optimizer(self.state, config, self.plan, self.modes, self.replica.engine),
            commit=self.side.commit_step,
            no_sync=_no_sync_handle(handle, config, micro_batched=self.micro_batched),
            outer=handle if self.periodic else None,  # its outer sync follows each step
        )
        self.periodic_run = PeriodicRun(handle, module, optimizer) if self.periodic else None
        if self.periodic_run is not None:
            self.replica.followers += [self.periodic_run, self.stepper]  # they follow a rebuilt handle
            algorithm = parse_sync(config.sync)
            fragmented = algorithm is not None and algorithm.fragmented
            self.state.register_outer_sync(self.periodic_run, streaming=fragmented)
        # From now on a lost member recovers the run (live mode): its replacements, a low-communication run's
        # rounds; every step and every collective work between steps goes through the side's driver.
        self.side.attach(
            replica=self.replica,
            state=self.state,
            shards=(self.data, self.evaluation, self.checkpoints),
            output=(self.runlog, self.bar),
        )

    # ---- phases -------------------------------------------------------------------------------------------

    def train(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Train to the end; (the summary, the logged history)."""
        if self.side.receive_state():  # a replacement: the state comes from a peer, not a checkpoint
            self.bar.advance(self.counters.step)
            if self.sampler.epoch > self.counters.epoch:  # admitted after an epoch's last step: the members
                self.counters.epoch += 1  # close that epoch now (checkpoint, evaluation), and so does it
                self._retry(self._end_of_epoch)
        else:
            self._retry(self._maybe_resume)
        self.side.mark_round()  # live mode, low-communication run: where a lost member's round is redone from
        started, start_samples, start_step = time.monotonic(), self.counters.samples, self.counters.step
        start_bytes = comm_bytes_so_far(self.replica.engine)
        self._train_to_end()
        wall = time.monotonic() - started
        summary = build_summary(
            self.state,
            self.config,
            world_size=self.replica.topo.world_size,
            plan=self.plan,
            restarts=self.side.restarts,
            run=(wall, self.counters.samples - start_samples, self.counters.step - start_step),
            comm_bytes=comm_bytes_since(self.replica.engine, start_bytes),
        )
        summary.update(bucket_summary(self.replica.engine), **checkpoint_summary(self.checkpoints))
        summary.update(straggler_summary(), **ACCOUNT.summary())
        if self.periodic_run is not None:
            summary.update(self.periodic_run.summary(self.record.faults))
        self.records.close()  # every rank's part of the timeline is whole once all stand here
        self._retry(barrier)
        if self.replica.topo.is_main:
            publish_summary(summary, self.run_dir, self.runlog, self.bar)
        self.side.close()  # published: a loss in the last barrier goes back nowhere
        self._retry(barrier)
        return summary, list(self.runlog.records)

    def _train_to_end(self) -> None:
        """The epochs, then the run's end. A low-communication run in live mode that went back to its
        round's start (RolledBack) carries on from there."""
        while True:
            try:
                while self.counters.step < self.total_steps and self.counters.epoch < self.config.epochs:
                    self._train_epoch()
                self._retry(self._end_of_run)
                return
            except RolledBack:
                self.side.rolled_back()
                self.bar.message(f"live: the round is redone from step {self.counters.step}")
                self.bar.advance(self.counters.step)

    def _end_of_run(self) -> None:
        self._log_train(force=True)
        if self.evaluation.enabled and self.record.eval_step != self.counters.step:
            self._evaluate()
        self._save_checkpoint()
        self.checkpoints.wait()  # checkpoint_async: the last write is complete before the run ends
        self.state.consolidate_optimizer()  # a sharded optimizer's full state on every rank, for the summary

    def _maybe_resume(self) -> None:
        if self.config.resume == "never" and self.checkpoints.steps():
            raise ConfigError(
                f"{self.run_dir} already holds checkpoints (steps {self.checkpoints.steps()!r}) and resume='never'; "
                "choose a new run_dir, delete the old checkpoints, or use resume='auto' to continue"
            )
        entries = self.state.registry.checkpoint_entries()
        # A restart of this job carries the time account on from the checkpoint (the time since it was
        # taken is lost to the restart); a new job that resumes leaves the time between jobs out
        step = self.records.load(self.checkpoints, entries) if self.config.resume == "auto" else None
        self.records.resumed(step, self.runlog, self.plan.global_batch_size)
        self.runlog.rewind(step or 0)
        if step is not None:
            self.record.saved_step = step
            self._finish_epoch_cut_at_checkpoint()
            self.bar.message(f"resumed from step {step} (epoch {self.counters.epoch}) in {self.run_dir}")
            self.bar.advance(self.counters.step)

    def _finish_epoch_cut_at_checkpoint(self) -> None:
        """A checkpoint taken on an epoch's last step holds the epoch as unfinished, but its sampler as done.

        The sampler knows where the data stands: count the epoch as done (else set_epoch would replay it),
        and run the end-of-epoch evaluation that the stopped run may not have reached.
        """
        if self.sampler.epoch <= self.counters.epoch:
            return
        self.counters.epoch = self.sampler.epoch
        if not self.evaluation.enabled or self.config.eval_every != 0:
            return
        logged = any(r.get("step") == self.counters.step and "eval_loss" in r for r in self.runlog.records)
        if not broadcast_object(logged):  # only rank 0 keeps the log; every rank must agree to evaluate
            self._evaluate()

    def _train_epoch(self) -> None:
        self.replica.module.train()
        self.data.start_epoch(self.counters.epoch)
        micro_batches, steps_left, micro_left = self.data.iterate()  # micro_left: this rank's, in the epoch
        self.stepper.synced = False
        while steps_left > 0 and self.counters.step < self.total_steps:
            PROGRESS.loop_step(self.counters.step + 1)  # the timeline's and the account's steps are fit's
            PROGRESS.set_phase(DATA)  # the hang watchdog names the phase a stuck rank is in
            wanted = min(self.data.micro_per_step, micro_left)
            group = _take(micro_batches, wanted)
            if len(group) < wanted or not (group or self.micro_batched):
                steps_left = 0  # the loader ended early (the dataset shrank under it): the epoch is done
                break
            outcome, synced = self.side.driver.attempt(partial(self._step, group))
            if outcome is Outcome.ROLLED_BACK:  # back to the round's start, maybe in an earlier epoch
                raise RolledBack
            if outcome is Outcome.REDO:  # live mode: the survivors go on
                del group
                micro_batches, steps_left, micro_left = self.data.iterate()  # the same step, re-cut
                continue
            micro_left -= len(group)
            steps_left -= 1
            self.counters.step += 1
            self.records.step_counted()
            self.runlog.reached(self.counters.step, ACCOUNT.samples_lost)  # should this attempt crash
            self.bar.advance(self.counters.step)
            if self.periodic_run is not None and self.counters.step == self.total_steps:
                self._retry(self.periodic_run.finish)  # before the last checkpoint and evaluation
            changed = self._retry(self._after_step)
            # replacements join; a round ends after its sync's step (at an epoch's end: below)
            changed = self.side.after_step(synced=bool(synced), more=steps_left > 0) or changed
            if changed and steps_left > 0:  # the shards were cut again: iterate the rest of the epoch anew
                micro_batches, steps_left, micro_left = self.data.iterate()
        if steps_left > 0:
            return  # stopped by the step budget in the middle of an epoch: stay in it (resumable)
        self.counters.epoch += 1
        self._retry(self._end_of_epoch)
        self.side.end_of_epoch(synced=self.stepper.synced)

    def _step(self, group: list[Any]) -> bool:
        """One step; True when it ended with an outer sync (a low-communication run's round)."""
        world_size = self.replica.topo.world_size
        if self.periodic:
            return self.stepper.local_step(self.replica.model, world_size, group)
        if not self.micro_batched:
            self.stepper.ddp_step(self.replica.model, world_size, group)
            return False
        if self.replica.handle is None:
            raise InternalError("a micro-batched step ran without a replica")
        self.stepper.micro_batched_step(self.replica.handle, self.replica.model, group)
        return False

    def _end_of_epoch(self) -> None:
        if self.config.checkpoint_every == 0:
            self._save_checkpoint()
        if (
            self.evaluation.enabled
            and self.config.eval_every == 0
            and self.record.eval_step != self.counters.step
        ):
            self._evaluate()

    def _retry(self, work: Callable[[], Any]) -> bool:
        """work(), done again over the survivors if a member is lost in its collectives (live mode).
        True when the group changed meanwhile (the loop re-cuts its iteration)."""
        driver = self.side.driver
        before = driver.changes
        driver.run(self.side.agreed(work))  # a low-communication run's loss: back to its mark, RolledBack
        return driver.changes != before

    def _after_step(self) -> None:
        self.state.gather_parameters()  # live mode, sharded optimizer: the step counted, now its all-gather
        step = self.counters.step
        if step % self.config.log_every == 0:
            self._log_train()
        if self.evaluation.enabled and self.config.eval_every and step % self.config.eval_every == 0:
            self._evaluate()
        if self.config.checkpoint_every and step % self.config.checkpoint_every == 0:
            self._save_checkpoint()

    def _log_train(self, force: bool = False) -> None:
        metrics = self.state.metrics
        if metrics.pending.count == 0 and not force:
            return
        means, count = metrics.pending.reduce(metrics.names("train"))  # collective: every rank is here
        self.side.logged(metrics)  # live mode: a later loss need not recover these rows
        if count == 0:
            return
        record = {
            "step": self.counters.step,
            "epoch": self.counters.epoch,
            **means,
            "lr": float(self.state.scheduler.get_last_lr()[0]),
        }
        self.record.last_train = record
        self.runlog.write(record)
        self.bar.report(self.counters.step, {k: v for k, v in record.items() if k != "epoch"})

    def _evaluate(self) -> None:
        self.record.last_eval = self.evaluation.run(self.replica.module)
        self.record.eval_step = self.counters.step
        record = {"step": self.counters.step, **self.record.last_eval}
        self.runlog.write(record)
        self.bar.message(
            " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
        )

    def _save_checkpoint(self) -> None:
        if self.record.saved_step == self.counters.step:
            return  # the epoch's end and the run's end can fall on the same step
        if self.periodic_run is not None:
            self.periodic_run.before_save()
        entries = self.state.registry.checkpoint_entries()
        self.checkpoints.save(self.counters.step, entries, blocking=not self.config.checkpoint_async)
        self.record.saved_step = self.counters.step


def _no_sync_handle(handle: Any, config: FitConfig, *, micro_batched: bool) -> Any:
    """The handle whose no_sync() ddp_step uses: with tuned buckets, and a sharded model's (FSDP2's gradient
    sync); none for micro-batched steps, which never call it (live mode cuts a sharded model anew)."""
    return handle if (tunes_buckets(config) or config.shard_degree > 1) and not micro_batched else None


def _take(iterator: Iterator[Any], count: int) -> list[Any]:
    group = []
    for _ in range(count):
        try:
            group.append(next(iterator))
        except StopIteration:
            break
    return group
