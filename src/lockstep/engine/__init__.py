"""lockstep's own data-parallel engine: wrap-time sync, gradient buckets, overlapped all-reduce, hooks.

Modules: policy (user knobs), bucketing (pure bucket assignment), init_sync (cross-rank model check and
broadcast), buckets (flat bucket memory, the hook-facing GradBucket), reducer (per-bucket
launch/wait/scale), state (per-model state and hook registration),
join (uneven inputs: ranks that ran out shadow the others' collectives),
stats (public timings), api (DistributedDataParallel and replicate).
"""

from __future__ import annotations
