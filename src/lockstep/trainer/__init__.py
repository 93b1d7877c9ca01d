"""The trainer: `fit()`, the loop that puts engine, sampler, checkpoints, metrics and progress together.

Public: `fit`, its settings `FitConfig` and its return value `FitResult`, and `LiveLoop` (live mode for a
loop of your own) (all re-exported by `lockstep`).
The modules behind them: config (FitConfig, from Python, files and --key value flags), loop (fit),
batches (split, move, count), optim (optimizer and LR schedule), metrics (one packed cross-rank
reduction), progress (rank 0's console display), run_log (rank 0's metric log and plot), live_fit
(live mode inside fit) and live_loop (LiveLoop).
"""

from __future__ import annotations

from lockstep.trainer.config import FitConfig
from lockstep.trainer.live_loop import LiveLoop
from lockstep.trainer.loop import FitResult, fit

__all__ = ["FitConfig", "FitResult", "LiveLoop", "fit"]
