"""`lockstep.fit`: the training loop that puts engine, sampler, checkpoints, metrics and progress together.

Every collective in here runs on every rank at the same point: the metric reduction on log steps, the
evaluation reduction, and the checkpoint save. Progress and logging only print on rank 0 and never
communicate, so no rank can be left waiting in a collective that rank 0 alone entered.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sized
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lockstep.checkpoint import CheckpointManager
from lockstep.checkpoint.compare import state_sha256
from lockstep.data import DistributedSampler, EvalSampler, MicroBatchSampler
from lockstep.engine.api import DistributedDataParallel, ReplicaHandle, replicate
from lockstep.engine.policy import SyncPolicy
from lockstep.engine.syncbn import convert_sync_batchnorm
from lockstep.errors import ConfigError, InternalError
from lockstep.runtime import barrier, broadcast_object, get_logger, init, live
from lockstep.runtime.micro_batches import owned_micro_batches
from lockstep.runtime.progress import DATA, EVALUATE, OPTIMIZER, PROGRESS, phase
from lockstep.runtime.topology import Topology
from lockstep.trainer import live_fit
from lockstep.trainer.batches import batch_len, plan_batches, split_batch, to_device
from lockstep.trainer.config import FitConfig, config_to_dict
from lockstep.trainer.metrics import MetricBuffer, OrderedMetrics
from lockstep.trainer.optim import build_optimizer, build_scheduler
from lockstep.trainer.progress import ProgressBar
from lockstep.trainer.run_log import RunLog

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class FitResult:
    """What a run produced; the same numbers are in run_dir/summary.json."""

    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


class TrainCounters:
    """Where the run is: optimizer steps taken, epochs finished, samples trained on; checkpointed for exact resume."""

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch, self.samples = (
            int(state["step"]),
            int(state["epoch"]),
            int(state.get("samples", 0)),
        )


def fit(
    model: nn.Module,
    train_data: Dataset,
    *,
    loss_fn: LossFn,
    config: FitConfig | None = None,
    eval_data: Dataset | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> FitResult:
    """Train `model` data-parallel on every rank of the job (a world of 1 under plain `python`).

    `optimizer`, when given, builds the optimizer from the parameters (default: from config.optimizer).
    Returns the summary on every rank; rank 0 also writes it, the logs and the plot to config.run_dir.
    """
    config = FitConfig() if config is None else config
    if not isinstance(config, FitConfig):
        raise ConfigError(
            f"fit(config={config!r}): expected a FitConfig (or None for the defaults), "
            f"got a {type(config).__name__}; build one with FitConfig(**settings)"
        )
    config.validate()  # again: fields may have been assigned since the config was built
    _require_map_style(train_data, "train_data")
    if eval_data is not None:
        _require_map_style(eval_data, "eval_data")
    topo = init()
    run = _Run(model, train_data, eval_data, loss_fn, config, topo, optimizer)
    try:
        return run.train()
    finally:
        run.close()


def _require_map_style(data: Any, what: str) -> None:
    """fit shards by index (its samplers need len()): an IterableDataset has neither."""
    if isinstance(data, IterableDataset) or not isinstance(data, Sized):
        raise ConfigError(
            f"fit() needs a map-style dataset (with __len__ and __getitem__) for {what}, got "
            f"{type(data).__name__}: its samplers shard by index and resume mid-epoch by position. "
            "Wrap the data in a map-style Dataset, or write your own loop with lockstep.DistributedDataParallel"
        )


class _Run:
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
        self.config, self.topo, self.loss_fn = config, topo, loss_fn
        self.log = get_logger("lockstep.fit")
        self.device = _choose_device(config.device)
        torch.manual_seed(config.seed + topo.rank)  # per-rank streams for dropout/augmentation
        if config.sync_batchnorm:
            model = convert_sync_batchnorm(model)
        self.module = model.to(self.device)
        self.live = live.current()
        # Live mode cuts every step into micro-batches (as deterministic mode does), so that a step lost
        # with a rank is redone over the survivors with the same samples; its global batch defaults to
        # the per-rank batch on every launched rank.
        self.plan = plan_batches(
            config, topo.world_size, live_world=self.live.launch_world_size if self.live else None
        )
        self.deterministic = config.deterministic
        self.micro_batched = self.plan.num_micro_batches > 0  # a step: K micro-batches through accumulate()
        pin = self.device.type == "cuda"  # pinned host memory lets to_device copy batches asynchronously
        # Its own generator, reseeded each epoch: otherwise iter(loader) draws worker seeds from the global
        # stream, and a resumed run (which calls iter() at another step) would shift every later draw.
        self.loader_generator = torch.Generator()
        self.handle: ReplicaHandle | None = None
        self.sampler: DistributedSampler | MicroBatchSampler
        if self.micro_batched:
            # Live mode: a member lost in the replica's start-up collectives is survived like any other.
            self.handle = live.retry_start(lambda: replicate(self.module, policy=self.replica_policy()))
            group = live.current()
            if group is not None:  # the members may have changed meanwhile
                self.topo = topo = group.topology()
            self.model: nn.Module = self.module
            self.sampler = MicroBatchSampler(
                cast(Sized, train_data),
                self.plan.micro_batch_size,
                self.plan.num_micro_batches,
                shuffle=True,
                seed=config.seed,
            )
            self.loader = DataLoader(
                train_data,
                batch_sampler=self.sampler,
                num_workers=config.num_workers,
                generator=self.loader_generator,
                pin_memory=pin,
            )
            self.micro_per_step = len(self.handle.owned_micro_batches(self.plan.num_micro_batches))
        else:
            self.model = DistributedDataParallel(
                self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
            # fit() checked that the datasets are map-style (_require_map_style).
            self.sampler = DistributedSampler(
                cast(Sized, train_data), shuffle=True, seed=config.seed, drop_last=True
            )
            self.loader = DataLoader(
                train_data,
                batch_size=self.plan.micro_batch_size,
                sampler=self.sampler,
                num_workers=config.num_workers,
                drop_last=True,
                generator=self.loader_generator,
                pin_memory=pin,
            )
            self.micro_per_step = self.plan.micro_batches_per_rank
        # The loop tells the sampler what it consumed: with DataLoader workers, what the sampler yielded
        # runs ahead of what was trained on, and resume must continue after the last trained sample.
        self.sampler.advance(0)
        self.eval_loader = _eval_loader(eval_data, config, topo, pin_memory=pin)
        self.steps_per_epoch = self._steps_in_epoch()
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"the training set of {len(train_data)} samples gives no full step of "  # type: ignore[arg-type]
                f"{self.plan.global_batch_size} samples on {topo.world_size} ranks; lower batch_size (or "
                "global_batch_size) or use fewer processes"
            )
        self.total_steps = config.epochs * self.steps_per_epoch
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        self.optimizer = (make_optimizer or (lambda p: build_optimizer(p, config)))(self.module.parameters())
        self.scheduler = build_scheduler(self.optimizer, config, self.total_steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.precision == "fp16")
        self.counters = TrainCounters()
        self.run_dir = Path(config.run_dir)
        self.checkpoints = CheckpointManager(self.run_dir, keep=config.keep_checkpoints)
        self.runlog = RunLog(self.run_dir, enabled=topo.is_main)
        self.bar = ProgressBar(self.total_steps, enabled=topo.is_main, mode=config.progress)
        self.train_metrics: MetricBuffer | OrderedMetrics = (
            OrderedMetrics() if self.micro_batched else MetricBuffer()
        )
        self.eval_data, self.pin = eval_data, pin
        # Members lost before fit began (at start-up) are faults of this run too.
        self.faults: list[dict[str, Any]] = [
            {"step": 0, **asdict(f), "recover_s": round(f.recover_s, 4)}
            for f in (self.live.faults if self.live is not None else [])
        ]
        self.last_eval: dict[str, float] = {}
        self.last_train: dict[str, float] = {}
        self.saved_step: int | None = None
        self.eval_step: int | None = None
        self.unlogged: list[
            tuple[int, int]
        ] = []  # live mode: (step, generation) committed since the last log

    # ---- phases -------------------------------------------------------------------------------------------

    def train(self) -> FitResult:
        if self.live is not None and self.live.needs_state:
            live_fit.receive_state(self)  # a replacement: the state comes from a peer, not a checkpoint
        else:
            self._live_retry(self._maybe_resume)
        started, start_samples, start_step = time.monotonic(), self.counters.samples, self.counters.step
        while self.counters.step < self.total_steps and self.counters.epoch < self.config.epochs:
            self._train_epoch()
        self._live_retry(self._end_of_run)
        wall = time.monotonic() - started
        return self._finish(wall, self.counters.samples - start_samples, self.counters.step - start_step)

    def _end_of_run(self) -> None:
        self._log_train(force=True)
        if self.eval_loader is not None and self.eval_step != self.counters.step:
            self._evaluate()
        self._save_checkpoint()

    def _maybe_resume(self) -> None:
        if self.config.resume == "never" and self.checkpoints.steps():
            raise ConfigError(
                f"{self.run_dir} already holds checkpoints (steps {self.checkpoints.steps()!r}) and resume='never'; "
                "choose a new run_dir, delete the old checkpoints, or use resume='auto' to continue"
            )
        step = self.checkpoints.load(self._state()) if self.config.resume == "auto" else None
        self.runlog.rewind(step or 0)
        if step is not None:
            self.saved_step = step
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
        if self.eval_loader is None or self.config.eval_every != 0:
            return
        step = self.counters.step
        logged = any(r.get("step") == step and "eval_loss" in r for r in self.runlog.records)
        if not broadcast_object(logged):  # only rank 0 keeps the log; every rank must agree to evaluate
            self._evaluate()

    def _steps_in_epoch(self) -> int:
        """Optimizer steps of the epoch the sampler is set to (fewer after a mid-epoch resume)."""
        if isinstance(self.sampler, MicroBatchSampler):
            return self.sampler.num_steps()
        return math.ceil(len(self.loader) / self.micro_per_step)

    def _train_epoch(self) -> None:
        self.module.train()
        self.sampler.set_epoch(self.counters.epoch)  # resumes mid-epoch when the loaded state stopped there
        self.loader_generator.manual_seed(self.config.seed * 1_000_003 + self.counters.epoch)
        steps_left = self._steps_in_epoch()
        micro_left = len(self.loader)  # this rank's micro-batches left in the epoch
        micro_batches = iter(self.loader)
        while steps_left > 0 and self.counters.step < self.total_steps:
            PROGRESS.set_phase(DATA)  # the hang watchdog names the phase a stuck rank is in
            wanted = min(self.micro_per_step, micro_left)
            group = _take(micro_batches, wanted)
            if len(group) < wanted or not (group or self.micro_batched):
                steps_left = 0  # the loader ended early (the dataset shrank under it): the epoch is done
                break
            try:
                if self.micro_batched:
                    self._micro_batched_step(group)
                else:
                    self._optimizer_step(group)
            except (RuntimeError, dist.DistError) as exc:
                if not live_fit.recover(self, exc):  # live mode: the survivors go on
                    raise
                del group
                micro_batches = iter(self.loader)  # the same step again, cut for the survivors
                steps_left, micro_left = self._steps_in_epoch(), len(self.loader)
                continue
            micro_left -= len(group)
            steps_left -= 1
            self.counters.step += 1
            self.bar.advance(self.counters.step)
            changed = self._live_retry(self._after_step)
            changed = live_fit.admit_joiners(self) or changed
            if changed and steps_left > 0:  # the shards were cut again: iterate the rest of the epoch anew
                micro_batches = iter(self.loader)
                steps_left, micro_left = self._steps_in_epoch(), len(self.loader)
        if steps_left > 0:
            return  # stopped by the step budget in the middle of an epoch: stay in it (resumable)
        self.counters.epoch += 1
        self._live_retry(self._end_of_epoch)

    def _end_of_epoch(self) -> None:
        if self.config.checkpoint_every == 0:
            self._save_checkpoint()
        if (
            self.eval_loader is not None
            and self.config.eval_every == 0
            and self.eval_step != self.counters.step
        ):
            self._evaluate()

    def _optimizer_step(self, group: list[Any]) -> None:
        counts = []
        for index, batch in enumerate(group):
            inputs, targets = to_device(split_batch(batch), self.device)
            counts.append(batch_len(targets))
            last = index == len(group) - 1
            # Accumulate locally; the engine reduces the summed gradients only on the group's last backward.
            with contextlib.nullcontext() if last else self.model.no_sync():  # type: ignore[operator]
                with self._autocast():
                    outputs = self.model(inputs)
                    loss = self.loss_fn(outputs, targets)
                self.scaler.scale(loss / len(group)).backward()
            self._record(cast(MetricBuffer, self.train_metrics), "train", outputs, targets, loss, counts[-1])
        self._update(sum(counts) * self.topo.world_size)

    def _micro_batched_step(self, group: list[Any]) -> None:
        """One step of K micro-batches (deterministic or live mode): this rank's through the engine's
        accumulate(), exact in deterministic mode, the bucketed float all-reduce otherwise."""
        handle = self.handle
        if handle is None:
            raise InternalError("_micro_batched_step ran without a replica")
        num = self.plan.num_micro_batches
        owned = handle.owned_micro_batches(num)
        results = handle.accumulate(
            self._micro_step,
            dict(zip(owned, group)),
            num_micro_batches=num,
            step=self.counters.step,
            seed=self.config.seed,
        )
        metrics = cast(OrderedMetrics, self.train_metrics)
        names = self._metric_names("train")
        rows = OrderedMetrics() if self.live is not None else metrics
        for ordinal, (sums, count) in results.items():
            rows.add(metrics.num_rows + ordinal, sums, count, names)  # rows since the last reduce
        if self.live is not None:
            # The step counts on every member or on none; its rows go with it to the store, where the
            # survivors find them if this rank is lost before the next log.
            packed = rows.packed()
            self.live.commit(self.counters.step, packed)
            self.unlogged.append((self.counters.step, self.live.membership.generation))
            metrics.add_packed(packed, names)
        metrics.num_rows += num
        self._update(self.plan.global_batch_size)

    def _micro_step(self, batch: Any) -> tuple[dict[str, torch.Tensor], int]:
        """Forward and backward of one micro-batch (through accumulate()); its metric sums and sample count."""
        inputs, targets = to_device(split_batch(batch), self.device)
        with self._autocast():
            outputs = self.model(inputs)
            loss = self.loss_fn(outputs, targets)
        self.scaler.scale(loss).backward()
        return self._sums("train", outputs, targets, loss, batch_len(targets))

    def _update(self, samples: int) -> None:
        """The optimizer's part of a step, after the gradients are averaged; `samples` over all ranks."""
        PROGRESS.set_phase(OPTIMIZER)
        if self.config.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.config.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.counters.samples += samples
        self.sampler.advance(samples)

    def _sums(
        self, prefix: str, outputs: Any, targets: Any, loss: torch.Tensor, count: int
    ) -> tuple[dict[str, torch.Tensor], int]:
        sums = {f"{prefix}_loss": loss.detach().double() * count}
        if self.config.task == "classification":
            sums[f"{prefix}_accuracy"] = (outputs.argmax(dim=-1) == targets).sum().double()
        return sums, count

    def _record(
        self, metrics: MetricBuffer, prefix: str, outputs: Any, targets: Any, loss: torch.Tensor, count: int
    ) -> None:
        """Add a batch's loss (and correct predictions) to `metrics` on the device: no copy to the host here."""
        metrics.add({f"{prefix}_loss": loss}, count)
        if self.config.task == "classification":
            metrics.add_sums({f"{prefix}_accuracy": (outputs.argmax(dim=-1) == targets).sum()}, 0)

    def _metric_names(self, prefix: str) -> list[str]:
        return [f"{prefix}_loss"] + ([f"{prefix}_accuracy"] if self.config.task == "classification" else [])

    def replica_policy(self) -> SyncPolicy:
        """The engine's policy for accumulate(): exact in deterministic mode, float sums otherwise."""
        return SyncPolicy(deterministic=self.deterministic)

    def _live_retry(self, work: Callable[[], Any]) -> bool:
        """work(), done again over the survivors if a member is lost in its collectives (live mode).
        True when the group changed meanwhile (the loop re-cuts its iteration)."""
        changed = False
        while True:
            try:
                work()
                return changed
            except (RuntimeError, dist.DistError) as exc:
                if not live_fit.recover(self, exc):
                    raise
                changed = True

    def reshard(self) -> None:
        """The group changed (live mode): this rank's shard of the data and of the evaluation, re-cut."""
        state = self.sampler.state_dict()
        self.sampler.num_replicas, self.sampler.rank = self.topo.world_size, self.topo.rank
        self.sampler.load_state_dict(state)
        self.eval_loader = _eval_loader(self.eval_data, self.config, self.topo, pin_memory=self.pin)

    def _after_step(self) -> None:
        step = self.counters.step
        if step % self.config.log_every == 0:
            self._log_train()
        if self.eval_loader is not None and self.config.eval_every and step % self.config.eval_every == 0:
            self._evaluate()
        if self.config.checkpoint_every and step % self.config.checkpoint_every == 0:
            self._save_checkpoint()

    def _log_train(self, force: bool = False) -> None:
        if self.train_metrics.count == 0 and not force:
            return
        means, count = self.train_metrics.reduce(
            self._metric_names("train")
        )  # collective: every rank is here
        if self.live is not None:
            self.live.forget_rows(self.unlogged)  # logged: a later loss need not recover them
            self.unlogged = []
        if count == 0:
            return
        record = {
            "step": self.counters.step,
            "epoch": self.counters.epoch,
            **means,
            "lr": float(self.scheduler.get_last_lr()[0]),
        }
        self.last_train = record
        self.runlog.write(record)
        self.bar.report(self.counters.step, {k: v for k, v in record.items() if k != "epoch"})

    @torch.no_grad()
    @phase(EVALUATE)
    def _evaluate(self) -> None:
        self.module.eval()  # the bare module: eval shards are unequal and must not trigger any collective
        names = self._metric_names("eval")
        sampler = self.eval_loader.batch_sampler if self.eval_loader is not None else None
        if isinstance(sampler, MicroBatchSampler):  # deterministic: blocks of a fixed size, summed in order
            blocks = OrderedMetrics()
            blocks.num_rows = sampler.num_micro_batches
            owned = owned_micro_batches(sampler.num_micro_batches, self.topo.world_size, self.topo.rank)
            for ordinal, batch in zip(owned, self.eval_loader or ()):
                blocks.add(ordinal, *self._eval_sums(batch), names)
            sums, total = blocks.reduce_sums(names)
        else:
            metrics = MetricBuffer()
            for batch in self.eval_loader or ():
                inputs, targets = to_device(split_batch(batch), self.device)
                with self._autocast():
                    outputs = self.module(inputs)
                    loss = self.loss_fn(outputs, targets)
                self._record(metrics, "eval", outputs, targets, loss, batch_len(targets))
            sums, total = metrics.reduce_sums(names)  # collective: every rank is here
        self.module.train()
        self.eval_step = self.counters.step
        means = {name: value / max(total, 1) for name, value in zip(names, sums)}
        self.last_eval = {"eval_loss": means["eval_loss"], "eval_samples": total}
        if "eval_accuracy" in means:
            self.last_eval["eval_accuracy"] = means["eval_accuracy"]
        record = {"step": self.counters.step, **self.last_eval}
        self.runlog.write(record)
        self.bar.message(
            " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
        )

    def _eval_sums(self, batch: Any) -> tuple[dict[str, torch.Tensor], int]:
        inputs, targets = to_device(split_batch(batch), self.device)
        with self._autocast():
            outputs = self.module(inputs)
            loss = self.loss_fn(outputs, targets)
        return self._sums("eval", outputs, targets, loss, batch_len(targets))

    def _save_checkpoint(self) -> None:
        if self.saved_step == self.counters.step:
            return  # the epoch's end and the run's end can fall on the same step
        self.checkpoints.save(self.counters.step, self._state())
        self.saved_step = self.counters.step

    def _state(self) -> dict[str, Any]:
        return {
            "model": self.module,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "sampler": self.sampler,
            "progress": self.counters,  # the checkpoint's key for the counters: older checkpoints use it too
        }

    def _finish(self, wall: float, samples: int, steps: int) -> FitResult:
        summary = {
            "world_size": self.topo.world_size,
            "steps": self.counters.step,
            "epochs_completed": self.counters.epoch,
            "steps_this_run": steps,
            "samples_this_run": samples,
            "wall_time_s": round(wall, 3),
            "samples_per_second": round(samples / wall, 2) if samples and wall > 0 else None,
            "global_batch_size": self.plan.global_batch_size,
            "micro_batch_size": self.plan.micro_batch_size,
            "deterministic": self.deterministic,
            "faults": self.faults,
            "restarts": 0 if self.live is not None else None,
            "params_sha256": state_sha256(self.module.state_dict()),
            "optimizer_sha256": state_sha256(self.optimizer.state_dict()),
            "final_train": self.last_train or None,
            **self.last_eval,
            "config": config_to_dict(self.config),
        }
        if "eval_accuracy" in self.last_eval:
            summary["test_accuracy"] = self.last_eval["eval_accuracy"]
        if self.topo.is_main:
            self.runlog.close()
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            plot = self.runlog.plot(self.run_dir / "curves.png")
            self.bar.close()
            self.log.info("run finished: %s", _headline(summary, plot))
        self._live_retry(barrier)
        return FitResult(summary=summary, history=list(self.runlog.records))

    def close(self) -> None:
        self.bar.close()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)


def _choose_device(requested: str) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "device='cuda' was asked for but torch.cuda.is_available() is False; use device='cpu'"
        )
    # init() bound this process's device (srun --gpus-per-task, shared nodes, ...): follow its choice
    return torch.device("cuda", torch.cuda.current_device())


def _eval_loader(
    eval_data: Dataset | None, config: FitConfig, topo: Topology, *, pin_memory: bool
) -> DataLoader | None:
    if eval_data is None:
        return None
    block = config.batch_size * 4
    if config.deterministic:  # blocks of a fixed size, assigned like micro-batches: one "step" of them all
        num_blocks = max(math.ceil(len(cast(Sized, eval_data)) / block), 1)
        sampler = MicroBatchSampler(
            cast(Sized, eval_data),
            block,
            num_blocks,
            num_replicas=topo.world_size,
            rank=topo.rank,
            shuffle=False,
            drop_last=False,
        )
        return DataLoader(
            eval_data, batch_sampler=sampler, num_workers=config.num_workers, pin_memory=pin_memory
        )
    return DataLoader(
        eval_data,
        batch_size=block,
        sampler=EvalSampler(cast(Sized, eval_data)),
        num_workers=config.num_workers,
        pin_memory=pin_memory,
    )


def _take(iterator: Iterator[Any], count: int) -> list[Any]:
    group = []
    for _ in range(count):
        try:
            group.append(next(iterator))
        except StopIteration:
            break
    return group


def _headline(summary: dict[str, Any], plot: Path | None) -> str:
    parts = [
        f"{summary['steps']} steps",
        f"{summary['wall_time_s']:.1f} s",
        f"{summary['samples_per_second']} samples/s",
    ]
    if "test_accuracy" in summary:
        parts.append(f"test_accuracy={summary['test_accuracy']:.4f}")
    if plot:
        parts.append(f"plot {plot}")
    return ", ".join(parts)
