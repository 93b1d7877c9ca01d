"""Sharding samples across ranks: a world-size-independent, resumable training order and exact evaluation."""

from __future__ import annotations

from lockstep.data.eval_sampler import EvalSampler
from lockstep.data.gather import gather_eval, reduce_eval
from lockstep.data.sampler import DistributedSampler

__all__ = ["DistributedSampler", "EvalSampler", "gather_eval", "reduce_eval"]
