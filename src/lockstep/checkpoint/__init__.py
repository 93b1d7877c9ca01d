"""Atomic, rank-0-written, weights_only-loadable checkpoints of everything a run needs to continue exactly."""

from __future__ import annotations

from lockstep.checkpoint.layout import CheckpointLayout
from lockstep.checkpoint.manager import CheckpointManager
from lockstep.checkpoint.stateful import Stateful

__all__ = ["CheckpointManager", "CheckpointLayout", "Stateful"]
