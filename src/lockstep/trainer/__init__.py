"""The trainer: `fit()`, the loop that puts engine, sampler, checkpoints, metrics and progress together.

Public: `fit`, its settings `FitConfig` and its return value `FitResult`, and `LiveLoop` (live mode for a
loop of your own) (all re-exported by `lockstep`).
The modules behind them: config (FitConfig, from Python, files and --key value flags), loop (fit's
phases), run_state (the run's state with one state_dict), steps (one optimizer step), evaluation, metrics
(what a task measures; one packed cross-rank reduction), summary (summary.json), batches (split, move,
count), device (device and autocast), optim (optimizer and LR schedule), progress (rank 0's console
display), run_log (rank 0's metric log and plot), live_takeover (a new rank 0 takes over a lost member's
rows and the log) and live_loop (LiveLoop). Live recovery itself is runtime/membership/recovery.py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lockstep.errors import UnknownNameError

if TYPE_CHECKING:
    from lockstep.trainer.api import FitResult, fit
    from lockstep.trainer.config import FitConfig
    from lockstep.trainer.live_loop import LiveLoop

__all__ = ["FitConfig", "FitResult", "LiveLoop", "fit"]
# Imported on first use: `lockstep train` reads a job's FitConfig (trainer/config.py, no torch) and checks
# its plan before anything imports torch.
_HOMES = {"FitConfig": "config", "FitResult": "api", "LiveLoop": "live_loop", "fit": "api"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise UnknownNameError(
            f"module 'lockstep.trainer' has no attribute {name!r}; its public names are {', '.join(__all__)}"
        )
    return getattr(importlib.import_module(f"lockstep.trainer.{_HOMES[name]}"), name)
