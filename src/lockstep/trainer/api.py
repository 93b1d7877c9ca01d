"""`lockstep.fit`: train a model data-parallel on every rank of the job, with checkpoints, metrics and logs.

The loop itself is trainer/loop.py (`FitRun`); this module checks what it is given and runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from lockstep.errors import ConfigError
from lockstep.runtime import init
from lockstep.trainer.loop import FitRun
from lockstep.trainer.reporting.run_records import RunRecords
from lockstep.trainer.run.steps import LossFn
from lockstep.trainer.settings.config import FitConfig


@dataclass
class FitResult:
    """What a run produced; the same numbers are in run_dir/summary.json."""

    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    # The trained model: the one passed to fit, except in live mode with shard_degree > 1 after a change of
    # members, where fit cut the model anew over the new group (the one passed keeps its earlier shards).
    model: nn.Module | None = None


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

    Args:
        model: the model, on the CPU or already on this rank's device; fit moves it to
            `config.device` and replicates it (BatchNorm becomes SyncBatchNorm if `config.sync_batchnorm`).
        train_data: a map-style dataset (with `__len__`); fit shards it over the ranks by index.
        loss_fn: `loss_fn(outputs, targets) -> scalar tensor`, the mean loss of a batch.
        config: the run's settings (`FitConfig()` when None): epochs, batch sizes, optimizer, precision,
            run_dir, checkpoints, deterministic and live mode.
        eval_data: a map-style dataset evaluated at `config.eval_every` (each sample on exactly one rank).
        optimizer: builds the optimizer from the parameters (default: from `config.optimizer`).

    Returns:
        A FitResult on every rank: the summary (also written to `run_dir/summary.json` by rank 0, with
        the logs and the plot) and the logged history.

    Raises:
        ConfigError: bad settings, an iterable dataset, or a run_dir with checkpoints under resume="never".
        CheckpointError: a checkpoint could not be written, or none of the existing ones could be loaded.
        WorldTooSmallError: live mode lost members until fewer than --min-world remain.
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
    try:
        run = FitRun(model, train_data, eval_data, loss_fn, config, topo, optimizer)
    except BaseException:
        RunRecords.failed()  # a timeline opened in the set-up stops recording
        raise
    try:
        summary, history = run.train()
    except BaseException:
        run.records.failed()  # this rank's timeline up to the failure (the launcher merges every rank's)
        raise
    finally:
        run.bar.close()
    return FitResult(summary=summary, history=history, model=run.replica.module)


def _require_map_style(data: Any, what: str) -> None:
    """fit shards by index (its samplers need len()): an IterableDataset has neither."""
    if isinstance(data, IterableDataset) or not isinstance(data, Sized):
        raise ConfigError(
            f"fit() needs a map-style dataset (with __len__ and __getitem__) for {what}, got "
            f"{type(data).__name__}: its samplers shard by index and resume mid-epoch by position. "
            "Wrap the data in a map-style Dataset, or write your own loop with lockstep.DistributedDataParallel"
        )
