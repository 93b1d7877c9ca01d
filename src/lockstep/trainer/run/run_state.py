"""The state of one `fit()` run, its entries registered once: what a checkpoint saves, what a replacement
receives, what a rollback puts back.

`RunState` holds everything a run must carry to continue exactly where it stands: the model, optimizer,
LR scheduler, GradScaler and sampler (each through its own state_dict), the counters (steps, epochs,
samples), and the run's record (last metrics, faults survived, what was saved and evaluated when, and in
live mode the metric rows pending since the last log). It registers each of them once in its
`StateRegistry` (trainer/run/registry.py), which does every snapshot and restore:

- a checkpoint holds `model`, `optimizer`, `scheduler`, `scaler`, `sampler` and `progress` (the
  counters; the names older checkpoints use too), and a low-communication run's `workers` and `outer`
  (a sharded one's `workers` alone, held rank by rank: trainer/run/low_comm.py's ShardedWorkers);
- a replacement receives those (the optimizer's param groups only when it is sharded: its state follows
  in regroup()), less `workers`, plus the record, the faults and the metric rows' positions: a run resumed
  from disk is a new process lifetime that starts its record afresh, whereas a replacement joins the run
  in progress;
- a round mark (trainer/live/live_rounds.py) holds what a replacement receives but the faults (a rollback
  keeps them), plus the metric sums pending and the random generators.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lockstep.checkpoint import rng
from lockstep.checkpoint.compare import state_sha256
from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.engine.sharded import full_tensors, is_sharded
from lockstep.runtime.memory import MemoryMeter
from lockstep.runtime.run_account import ACCOUNT
from lockstep.trainer.reporting.metrics import TrainMetrics
from lockstep.trainer.run.registry import EVERY, RECOVERY, StateRegistry, Use


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


class RunRecord:
    """What this run has done so far, beyond the counters: for its summary, and so that work is neither
    skipped nor done twice (a save and an evaluation at the same step)."""

    def __init__(self) -> None:
        self.last_train: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.faults: list[dict[str, Any]] = []  # live mode: membership changes (summary.json's `faults`)
        self.saved_step: int | None = None
        self.eval_step: int | None = None

    def state_dict(self) -> dict[str, Any]:
        """Where the record stands (a rollback puts it back); the faults are an entry of their own, which
        a rollback keeps."""
        return {
            "last_train": self.last_train,
            "last_eval": self.last_eval,
            "saved_step": self.saved_step,
            "eval_step": self.eval_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_train, self.last_eval = dict(state["last_train"]), dict(state["last_eval"])
        self.saved_step, self.eval_step = state["saved_step"], state["eval_step"]

    def load_faults(self, faults: list[dict[str, Any]]) -> None:
        self.faults = list(faults)


class RunState:
    """One fit() run's state (see the module doc)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | ShardedOptimizer,
        scheduler: Any,
        scaler: torch.amp.GradScaler,
        sampler: Any,
        metrics: TrainMetrics,
    ) -> None:
        self.module, self.optimizer, self.scheduler, self.scaler = module, optimizer, scheduler, scaler
        self.sampler, self.metrics = sampler, metrics
        self.counters = TrainCounters()
        self.record = RunRecord()
        self.memory = MemoryMeter()  # the model state's bytes, sampled in a step (summary.json's `memory`)
        self.registry = StateRegistry()
        # a sharded model's parameters and optimizer state reach a replacement shard for shard
        # (trainer/live/live_shards.py), not in rank 0's state: its optimizer's hyperparameters do
        self.sharded = is_sharded(module)
        self.hashes: tuple[str, str] | None = None  # the full parameters' and optimizer state's, at the end
        self._model_uses = Use.CHECKPOINT | Use.MARK if self.sharded else EVERY
        self._register()

    def _register(self) -> None:
        """The run's entries (a low-communication run adds `workers` and `outer`: trainer/run/low_comm.py)."""
        reg = self.registry
        reg.register_state_dict_fn(
            "model", self._load_model, self.module.state_dict, uses=self._model_uses, target=self.module
        )
        reg.register_state_dict_fn(
            "optimizer",
            self.optimizer.load_state_dict,
            self._optimizer_state,
            uses=self._model_uses,
            target=self.optimizer,
        )
        if self.sharded:
            reg.register_state_dict_fn(
                "optimizer_settings", self._load_settings, self._settings, uses=Use.TRANSFER
            )
        reg.register("scheduler", self.scheduler)
        reg.register_state_dict_fn(
            "scaler", self._load_scaler, self.scaler.state_dict, uses=EVERY, target=self.scaler
        )
        reg.register("sampler", self.sampler)
        reg.register(
            "progress", self.counters
        )  # the checkpoint's key for the counters: older ones use it too
        reg.register("record", self.record, uses=RECOVERY)
        reg.register_state_dict_fn(
            "faults", self.record.load_faults, lambda: self.record.faults, uses=Use.TRANSFER
        )
        reg.register("metrics", self.metrics, uses=RECOVERY)
        reg.register_state_dict_fn(
            "metric_sums", self._load_pending, lambda: self.metrics.pending, uses=Use.MARK
        )
        reg.register_state_dict_fn("rng", rng.restore, rng.capture, uses=Use.MARK)
        # The run's time account (runtime/run_account.py): a restart carries on from the checkpoint's, a
        # replacement from rank 0's; never a rollback's mark (the work it discards stays counted as lost)
        reg.register("goodput", ACCOUNT, uses=Use.CHECKPOINT | Use.TRANSFER)

    def use_module(self, module: nn.Module) -> None:
        """Live mode, sharded: the model was cut anew over a new group (a new module object, the optimizer
        moved onto it): the run's entries name it from now on."""
        self.module = module
        self.registry.retarget("model", module, module.state_dict)

    def register_outer_sync(self, periodic: Any, *, streaming: bool) -> None:
        """A low-communication run's entries (`periodic`: trainer/run/low_comm.py's PeriodicRun), after model and optimizer (a rank's own
        state in `workers` replaces rank 0's on a checkpoint's load): every rank's state, in checkpoints
        only; the outer sync state (`outer`, an OuterState: its handle follows the rebuilt replica). A
        streaming run's mean in flight is kept as this rank's contribution, not waited for (a mark is taken
        at each fragment's sync); a replacement joins after that mean is back (LiveRounds.settle).

        A sharded periodic run (periodic.sharded) registers `workers` alone: every rank's own shards, inner
        optimizer and outer state, written and read back by that rank (ShardedWorkers), in checkpoints only
        (its state is no replacement's or rollback's: live mode does not run sharded)."""
        workers, outer = periodic.workers, periodic.outer
        self.registry.register("workers", workers, uses=Use.CHECKPOINT)
        if outer is None:
            return
        self.registry.register_state_dict_fn(
            "outer",
            outer.load_state_dict,
            lambda: dict(outer.handle.sync_state_dict(wait=not streaming)),
            uses=EVERY,
            target=outer,
        )

    def _load_model(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.module.load_state_dict(state)

    def _optimizer_state(self) -> dict[str, Any]:
        # A sharded optimizer's state reaches a replacement through regroup(), from the ranks that hold it
        # (a low-communication run, whose marks hold the optimizer, never shards it: trainer/run/optim.py).
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.transfer_state_dict()
        return self.optimizer.state_dict()

    def _settings(self) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters (its param_groups without their parameters: the lr where the
        schedule left it)."""
        return [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def _load_settings(self, settings: list[dict[str, Any]]) -> None:
        for group, values in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(values)

    def _load_scaler(self, state: dict[str, Any]) -> None:
        if state:  # a disabled GradScaler's state is empty, and it loads nothing
            self.scaler.load_state_dict(state)

    def _load_pending(self, pending: Any) -> None:
        self.metrics.pending = pending

    def marks(self) -> dict[str, Any]:
        """Where the run stands, for live recovery to compare across members (runtime/membership/recovery.py)."""
        return {
            "step": self.counters.step,
            "saved_step": self.record.saved_step,
            "eval_step": self.record.eval_step,
            "pending_metrics": self.metrics.pending.count,
        }

    def reconcile(self, mark: str) -> None:
        """Forget what the members disagree on (`mark`), so that it is done again."""
        if mark == "saved_step":
            self.record.saved_step = None
        elif mark == "eval_step":
            self.record.eval_step = None
        elif mark == "pending_metrics":
            self.metrics.drop_pending()

    # A sharded optimizer (FitConfig.shard_optimizer) is a collective's worth more work at a few points.
    def gather_parameters(self) -> None:
        """After a step counted: the parameters' updated values from their owners (live mode's deferred
        all-gather of a sharded optimizer; nothing otherwise)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.gather()

    def set_aside(self) -> None:
        """Before a change of members (live mode): a sharded optimizer's values not yet all-gathered."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.set_aside()

    def regroup(self) -> None:
        """After a change of members (live mode): a sharded optimizer's shares re-cut over the new group."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.regroup()

    def consolidate_optimizer(self) -> None:
        """A sharded optimizer's full state collected on every rank, and the hashes of the full parameters
        and optimizer state (summary.json's): a sharded model's gather them, collectives that the run's end
        does here, where a lost member is survived, not in the summary."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.consolidate_state_dict(to=None)
        self.take_hashes()

    def take_hashes(self) -> tuple[str, str]:
        """The hashes of the full parameters and optimizer state, kept (collectives for a sharded model)."""
        self.hashes = (
            state_sha256(full_tensors(self.module.state_dict())),
            state_sha256(full_tensors(self.optimizer.state_dict())),
        )
        return self.hashes
