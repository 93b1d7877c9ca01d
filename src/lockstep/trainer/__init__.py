"""The trainer: `fit()`, the loop that puts engine, sampler, checkpoints, metrics and progress together.

Public: `fit`, its settings `FitConfig` and its return value `FitResult`, and `LiveLoop` (live mode for a
loop of your own) (all re-exported by `lockstep`).
Live recovery itself is runtime/membership/recovery.py.

Modules:
- api.py: `lockstep.fit`: train a model data-parallel on every rank of the job, with checkpoints, metrics and
  logs.
- loop.py: fit's loop: the phases of one run (resume, epochs, steps, logs, evaluation, checkpoints, the end).
- summary.py: The summary of a fit() run: what summary.json holds, and rank 0's last words (log, plot, one
  line).
- live/: Live mode in the trainer: fit's side of it and `LiveLoop`, a loop of the program's own that survives
  a lost rank (the recovery itself is runtime/membership/recovery.py, shared by both).
- reporting/: What a run tells as it goes: its metrics (reduced across ranks), the console progress on rank 0,
  and the metric log.
- run/: The parts of one fit run below its loop: its state and registry, its data, its steps and the step
  driver, its replica, optimizer and bucket size, its evaluation, low-communication training's side.
- settings/: A run's settings: `FitConfig`, from Python, config files and `--key value` flags (no torch
  imported: `lockstep train` reads a job's settings and checks its plan before any worker starts).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lockstep.errors import UnknownNameError

if TYPE_CHECKING:
    from lockstep.trainer.api import FitResult, fit
    from lockstep.trainer.live.live_loop import LiveLoop
    from lockstep.trainer.settings.config import FitConfig

__all__ = ["FitConfig", "FitResult", "LiveLoop", "fit"]
# Imported on first use: `lockstep train` reads a job's FitConfig (trainer/settings/config.py, no torch) and checks
# its plan before anything imports torch.
_HOMES = {"FitConfig": "settings.config", "FitResult": "api", "LiveLoop": "live.live_loop", "fit": "api"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise UnknownNameError(
            f"module 'lockstep.trainer' has no attribute {name!r}; its public names are {', '.join(__all__)}"
        )
    return getattr(importlib.import_module(f"lockstep.trainer.{_HOMES[name]}"), name)
