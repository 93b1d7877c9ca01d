"""Helpers for testing distributed code for real: N gloo ranks in subprocesses with a hard timeout."""

from __future__ import annotations

from lockstep.testing.collectives import watch_collectives
from lockstep.testing.spawn import run_distributed

__all__ = ["run_distributed", "watch_collectives"]
