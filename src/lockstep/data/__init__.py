"""Sharding samples across ranks: a world-size-independent, resumable training order and exact evaluation.

Public: `DistributedSampler` (drop-in for torch's, plus state_dict() and mid-epoch resume at any world
size), `MicroBatchSampler` (deterministic mode: each step's fixed micro-batches, this rank's share),
`EvalSampler` (every sample on exactly one rank, no padding) and the collectives that combine per-rank
evaluation results, `gather_eval` (rows with their indices) and `reduce_eval` (sums and counts).
"""

from __future__ import annotations

from lockstep.data.eval_sampler import EvalSampler
from lockstep.data.gather import gather_eval, reduce_eval
from lockstep.data.micro_batch_sampler import MicroBatchSampler
from lockstep.data.sampler import DistributedSampler

__all__ = ["DistributedSampler", "EvalSampler", "MicroBatchSampler", "gather_eval", "reduce_eval"]
