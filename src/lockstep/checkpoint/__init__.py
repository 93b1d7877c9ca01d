"""Atomic, rank-0-written, weights_only-loadable checkpoints of everything a run needs to continue exactly.

Public: `CheckpointManager(run_dir, keep=3)` (save, load, steps), `CheckpointLayout` (where a run's
checkpoints live on disk) and `Stateful` (the state_dict()/load_state_dict() protocol every entry follows;
checkpoints never import the engine or the data package), `compare_checkpoints` (are two checkpoints or
runs bitwise equal, and if not, the first entry that differs) and `state_sha256` (the hash summary.json
records). The modules behind them: layout (pure paths), compare,
storage (atomic writes), meta (meta.json), rng (every rank's RNG states), stateful and manager.
"""

from __future__ import annotations

from lockstep.checkpoint.compare import Comparison, compare_checkpoints, state_sha256
from lockstep.checkpoint.layout import CheckpointLayout
from lockstep.checkpoint.manager import CheckpointManager
from lockstep.checkpoint.stateful import Stateful

__all__ = [
    "CheckpointLayout",
    "CheckpointManager",
    "Comparison",
    "Stateful",
    "compare_checkpoints",
    "state_sha256",
]
