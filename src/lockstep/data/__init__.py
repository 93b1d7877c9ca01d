"""Sharding samples across ranks: a world-size-independent, resumable training order and exact evaluation.

Public: `DistributedSampler` (drop-in for torch's, plus state_dict() and mid-epoch resume at any world
size), `MicroBatchSampler` (deterministic mode: each step's fixed micro-batches, this rank's share),
`EvalSampler` (every sample on exactly one rank, no padding) and the collectives that combine per-rank
evaluation results, `gather_eval` (rows with their indices) and `reduce_eval` (sums and counts).

Modules:
- eval_sampler.py: Shard an evaluation set so that every sample is seen by exactly one rank, with no padding.
- gather.py: Combine per-rank evaluation results exactly: per-sample rows with their indices, or sums and
  counts.
- micro_batch_sampler.py: Deterministic mode's sampler: each step's global batch cut into fixed micro-batches,
  the same at any world size.
- sampler.py: Shard each epoch's sample order across ranks so that it depends only on (seed, epoch) and
  resumes exactly.
"""

from __future__ import annotations

from lockstep.data.eval_sampler import EvalSampler
from lockstep.data.gather import gather_eval, reduce_eval
from lockstep.data.micro_batch_sampler import MicroBatchSampler
from lockstep.data.sampler import DistributedSampler

__all__ = ["DistributedSampler", "EvalSampler", "MicroBatchSampler", "gather_eval", "reduce_eval"]
