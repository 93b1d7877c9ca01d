"""fit's bucket size (FitConfig.bucket_cap_mb): the replica's policy with it, and what summary.json says of it.

None keeps today's runs as they are: torch's 25 MiB through the drop-in class (torch's layout and bits),
or the engine's default under accumulate(). A number goes to the drop-in class as torch's bucket_cap_mb
(or into the replica's policy under accumulate()). "auto" makes fit's default steps run through
`replicate` with SyncPolicy(bucket_cap_mb="auto"): the drop-in class keeps torch's layout, so it cannot
tune (engine/buckets/bucket_tuner.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lockstep.engine.core.policy import AUTO, SyncPolicy
from lockstep.trainer.run.low_comm import engine_policy
from lockstep.trainer.settings.config import FitConfig

SUMMARY_KEYS = ("bucket_cap_mb", "bucket_tuning_reason", "bucket_trials", "bucket_timing")


def tunes_buckets(config: FitConfig) -> bool:
    """fit's default steps run through replicate, whose engine chooses the bucket size."""
    return config.bucket_cap_mb == AUTO


def fit_policy(config: FitConfig) -> SyncPolicy:
    """The replica's policy (low_comm.engine_policy) with the run's bucket size, where buckets exist (the
    run's plan refused a size with deterministic mode, a periodic sync or, "auto", live mode at the door)."""
    policy = engine_policy(config)
    cap = config.bucket_cap_mb
    if cap is None:
        return policy
    # shard_optimizer, the memory-saving option: the gradients as views of the buckets, as in loop.py
    return dataclasses.replace(policy, bucket_cap_mb=cap, gradient_as_bucket_view=config.shard_optimizer)


def bucket_summary(engine: Any) -> dict[str, Any]:
    """summary.json's report of a tuned bucket size (the chosen cap, why, each candidate's timed steps);
    empty when the size was not tuned."""
    extras = engine.stats().extras
    return {key: extras[key] for key in SUMMARY_KEYS if key in extras}
