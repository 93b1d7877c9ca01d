"""The state of one `fit()` run, with one state_dict: what a checkpoint saves and what a replacement receives.

`RunState` holds everything a run must carry to continue exactly where it stands: the model, optimizer,
LR scheduler, GradScaler and sampler (each through its own state_dict), the counters (steps, epochs,
samples), and the run's record (last metrics, faults survived, what was saved and evaluated when, and in
live mode the metric rows pending since the last log).

`state_dict()` is what live mode sends a replacement (runtime/membership/recovery.py). A checkpoint holds
the same entries but the record (`checkpoint_entries()`: the objects, which CheckpointManager stores in
safetensors and weights_only files under the names older checkpoints use too): a run resumed from disk is
a new process lifetime that starts its record afresh, whereas a replacement joins the run in progress.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lockstep.engine.shard_optimizer import ShardedOptimizer
from lockstep.trainer.metrics import TrainMetrics


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
        return {
            "last_train": self.last_train,
            "last_eval": self.last_eval,
            "faults": self.faults,
            "saved_step": self.saved_step,
            "eval_step": self.eval_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_train, self.last_eval = dict(state["last_train"]), dict(state["last_eval"])
        self.faults = list(state["faults"])
        self.saved_step, self.eval_step = state["saved_step"], state["eval_step"]


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
        self.extra: dict[
            str, Any
        ] = {}  # entries of a low-communication run: every rank's state, the outer state

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

    def checkpoint_entries(self) -> dict[str, Any]:
        """The objects a checkpoint stores, by the names it stores them under."""
        return {
            "model": self.module,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "sampler": self.sampler,
            "progress": self.counters,  # the checkpoint's key for the counters: older checkpoints use it too
            **self.extra,  # after model and optimizer: a rank's own state replaces rank 0's on load
        }

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
        """A sharded optimizer's full state collected on every rank (for the summary's hash)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.consolidate_state_dict(to=None)

    def state_dict(self) -> dict[str, Any]:
        entries = self.checkpoint_entries()
        optimizer = entries.pop("optimizer")
        state = {name: obj.state_dict() for name, obj in entries.items()}
        # A sharded optimizer's state reaches a replacement through regroup(), from the ranks that hold it.
        sharded = isinstance(optimizer, ShardedOptimizer)
        state["optimizer"] = optimizer.transfer_state_dict() if sharded else optimizer.state_dict()
        state["record"] = self.record.state_dict()
        state["metrics"] = self.metrics.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # a disabled GradScaler's state is empty, and it loads nothing
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        self.counters.load_state_dict(state["progress"])
        self.record.load_state_dict(state["record"])
        self.metrics.load_state_dict(state["metrics"])
