"""One optimizer step of fit: its forwards and backwards, the metrics they give, then the optimizer.

Two ways to run a step, chosen once per run (trainer/loop.py):
- `ddp_step`: the default. This rank's micro-batches through torch's drop-in face (DistributedDataParallel),
  or the module replicated in place with bucket_cap_mb="auto" (trainer/run/buckets.py), gradients
  accumulated locally (no_sync) and reduced on the last backward;
- `micro_batched_step`: deterministic and live mode. The step's K micro-batches are spread over the ranks
  and run through the engine's accumulate(): an exact sum in deterministic mode,
  the bucketed float all-reduce otherwise. The step's metric rows are handed to the run's `commit`
  (trainer/live/live_side.py: in live mode the step counts on every member or on none, and its rows go to
  the store with it, where the survivors find them if this rank is lost before the next log).

A Stepper is built in its mode, once: what `_update` steps, the handle whose no_sync() a tuned-bucket step
uses, the handle whose outer sync follows each step of a low-communication run, and the commit.

With config.overlap_optimizer, `ddp_step`'s optimizer is an OverlappedOptimizer that the engine steps
bucket by bucket during the synced backward (`stepped_optimizer`); `_update` is unchanged: its
`scaler.step` finishes what is left, or takes the plain step where the engine fell back. With
config.shard_optimizer as well, it wraps the run's ShardedOptimizer: the engine steps this rank's share
of each bucket and starts the owners' broadcasts; `scaler.step` waits for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine.deterministic.exact_norm import exact_clip_grad_norm_
from lockstep.engine.optim.overlapped_optimizer import OverlappedOptimizer
from lockstep.engine.replicate import overlap_optimizer
from lockstep.errors import InternalError, rank_tag
from lockstep.plan import Plan, Reduction
from lockstep.runtime.progress import BACKWARD, FORWARD, OPTIMIZER, PROGRESS
from lockstep.trainer.reporting.metrics import MetricBuffer, OrderedMetrics, TrainMetrics
from lockstep.trainer.run.batches import BatchPlan, batch_len, split_batch, to_device
from lockstep.trainer.run.device import autocast
from lockstep.trainer.run.run_state import RunState
from lockstep.trainer.settings.config import FitConfig

LossFn = Callable[[Any, Any], torch.Tensor]
# How a micro-batched step's metric rows are kept: (step, its rows, the run's metrics) (live_side.py)
Commit = Callable[[int, OrderedMetrics, TrainMetrics], None]


def stepped_optimizer(
    state: RunState, config: FitConfig, batches: BatchPlan, modes: Plan, model: nn.Module
) -> Any:
    """What fit's steps step: the run's optimizer (a ShardedOptimizer offers what GradScaler and clipping
    read: param_groups, step; every rank holds every averaged gradient, so found_inf and the gradient norm
    agree across ranks), or, with config.overlap_optimizer, the one the engine steps bucket by bucket
    during the backward of the drop-in `model` (the run's state keeps the optimizer itself: checkpoints and
    the schedule see it). Where fit's steps never reduce in backward (a periodic sync, deterministic and
    live mode's micro-batches), the step stays plain, for the reason the plan gives, said once."""
    optimizer = cast(torch.optim.Optimizer, state.optimizer)
    if not config.overlap_optimizer:
        return optimizer
    if modes.reduction is not Reduction.BUCKETED or batches.num_micro_batches or config.shard_degree > 1:
        rule = modes.fallback("overlap_optimizer")
        if rule is None:
            raise InternalError(f"the plan has no fallback for overlap_optimizer in {modes.settings}")
        tag = rank_tag(dist.get_rank(), dist.get_world_size())
        return OverlappedOptimizer(optimizer, fallback=rule.reason, tag=tag)
    return overlap_optimizer(  # the engine asks the plan too (clipping, the fp16 scaler)
        model,  # type: ignore[arg-type]  # the drop-in class (a JoinableReplica)
        optimizer,  # the run's own, sharded (a ShardedOptimizer) with config.shard_optimizer
        clip_grad_norm=config.clip_grad_norm is not None,
        scaler=state.scaler,
        plan=modes,  # the run's, built once at fit's door
    )


class Stepper:
    """Runs fit's steps on a run's state, in the mode it is built in (see the module doc)."""

    def __init__(
        self,
        state: RunState,
        config: FitConfig,
        plan: BatchPlan,
        loss_fn: LossFn,
        device: torch.device,
        *,
        optimizer: Any,
        commit: Commit,
        no_sync: Any = None,
        outer: Any = None,
    ) -> None:
        """`optimizer`: what `_update` steps (`stepped_optimizer`); `commit`: keeps a micro-batched step's
        metric rows; `no_sync`: bucket_cap_mb="auto", ddp_step's handle (its model is the module itself);
        `outer`: low-communication training, the replica handle that syncs after each step."""
        self.state, self.config, self.plan, self.loss_fn, self.device = state, config, plan, loss_fn, device
        self.optimizer: torch.optim.Optimizer = optimizer
        self.commit, self.no_sync, self.outer = commit, no_sync, outer
        self.synced = False  # whether the last step ended with an outer sync

    def rebind(self, handle: Any) -> None:
        """A low-communication run over a new group: the replica was rebuilt; its new handle syncs after each
        step."""
        self.outer = handle

    def ddp_step(self, model: nn.Module, world_size: int, batches: list[Any], *, local: bool = False) -> None:
        """This rank's micro-batches of the step through the DDP wrapper `model` (or, `local`, the plain
        module), then the optimizer."""
        state = self.state
        counts = []
        for index, batch in enumerate(batches):
            if index:  # a forward under no_sync() starts no step: say it is one
                PROGRESS.set_phase(FORWARD)
            inputs, targets = to_device(split_batch(batch), self.device)
            counts.append(batch_len(targets))
            last = index == len(batches) - 1
            # Accumulate locally; the engine reduces the summed gradients only on the group's last backward (a
            # local step reduces nothing, but a sharded model's does, inside its group: its no_sync() too).
            accumulate = not last and (not local or self.no_sync is not None)
            with (self.no_sync or model).no_sync() if accumulate else contextlib.nullcontext():  # type: ignore[operator]
                with autocast(self.config.precision, self.device):
                    outputs = model(inputs)
                    loss = self.loss_fn(outputs, targets)
                PROGRESS.set_phase(BACKWARD)  # the engine's hooks say so too; a local step has none
                state.scaler.scale(loss / len(batches)).backward()
            pending = cast(MetricBuffer, state.metrics.pending)
            state.metrics.record(pending, "train", outputs, targets, loss, counts[-1])
        # A step's global batch: cut into micro-batches (deterministic and live mode, where the ranks may own
        # unequal numbers of them), or this rank's share times the ranks.
        self._update(self.plan.global_batch_size if self.plan.num_micro_batches else sum(counts) * world_size)

    def local_step(self, module: nn.Module, world_size: int, batches: list[Any]) -> bool:
        """Low-communication training (FitConfig.sync): this rank's batches of the step through its own
        module, no gradient averaged, then the optimizer and the handle's outer sync when one is due.
        True when the step ended with an outer sync (a round's end, for local_sgd and diloco)."""
        self.synced = False
        self.ddp_step(module, world_size, batches, local=True)
        return self.synced

    def micro_batched_step(self, handle: Any, model: nn.Module, batches: list[Any]) -> None:
        """One step of K micro-batches (deterministic or live mode): this rank's through the engine's
        accumulate(), exact in deterministic mode, the bucketed float all-reduce otherwise."""
        state = self.state
        num = self.plan.num_micro_batches
        owned = handle.owned_micro_batches(num)
        results = handle.accumulate(
            lambda batch: self._micro_step(model, batch),
            dict(zip(owned, batches)),
            num_micro_batches=num,
            step=state.counters.step,
            seed=self.config.seed,
        )
        metrics = cast(OrderedMetrics, state.metrics.pending)
        names = state.metrics.names("train")
        rows = OrderedMetrics()
        for ordinal, (sums, count) in results.items():
            rows.add(metrics.num_rows + ordinal, sums, count, names)  # rows since the last reduce
        self.commit(state.counters.step, rows, state.metrics)  # live mode: the step counts, or raises
        metrics.num_rows += num
        self._update(self.plan.global_batch_size)

    def _micro_step(self, model: nn.Module, batch: Any) -> tuple[dict[str, torch.Tensor], int]:
        """Forward and backward of one micro-batch (through accumulate()); its metric sums and sample count."""
        PROGRESS.set_phase(FORWARD)  # each micro-batch's phases, for the timeline and the hang reports
        inputs, targets = to_device(split_batch(batch), self.device)
        with autocast(self.config.precision, self.device):
            outputs = model(inputs)
            loss = self.loss_fn(outputs, targets)
        PROGRESS.set_phase(BACKWARD)
        self.state.scaler.scale(loss).backward()
        return self.state.metrics.sums("train", outputs, targets, loss, batch_len(targets))

    def _update(self, samples: int) -> None:
        """The optimizer's part of a step, after the gradients are averaged; `samples` over all ranks."""
        state = self.state
        PROGRESS.set_phase(OPTIMIZER)
        if self.outer is not None:
            self.outer.before_optimizer_step()  # a low-communication run's warm-up: averaged gradients
        if self.config.clip_grad_norm is not None:
            state.scaler.unscale_(self.optimizer)  # the object step() gets: the scaler tracks it by id
            # deterministic mode: one exact norm, the same bits replicated or sharded at any layout
            clip = exact_clip_grad_norm_ if self.config.deterministic else torch.nn.utils.clip_grad_norm_
            clip(state.module.parameters(), self.config.clip_grad_norm)
        state.scaler.step(self.optimizer)
        state.scaler.update()
        state.memory.sample(state.module, state.optimizer)  # grads and optimizer state both exist here
        state.optimizer.zero_grad(set_to_none=True)
        state.scheduler.step()
        if self.outer is not None:
            self.synced = self.outer.after_optimizer_step()  # every sync_every steps: the replicas meet
        state.counters.samples += samples
        state.sampler.advance(samples)
