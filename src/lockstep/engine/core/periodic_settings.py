"""PeriodicSettings: SyncPolicy's knobs of low-communication training, read by engine/periodic/.

SyncPolicy (policy.py) takes every knob as a keyword and builds this part from its periodic knobs; this
module holds what they need (the sync algorithms and the wire formats), so that the bucketed reducer,
which reads only BucketSettings (bucket_settings.py), reaches neither. The messages name SyncPolicy,
the class the user constructs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.engine.core.sync_algorithms import SyncAlgorithm, parse_sync
from lockstep.errors import ConfigError


@dataclass(frozen=True)
class PeriodicSettings:
    """The periodic sync's knobs: the meaning and default of each field is SyncPolicy's."""

    sync: str = "allreduce"
    sync_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    warmup_steps: int = 0
    mix: float = 0.5
    outer_momentum_warmup: int = 10
    fragment_layout: str = "sliced"
    fragment_delay: int = 1
    fragments: int = 1
    delta_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        self._check_sync()

    @property
    def algorithm(self) -> type[SyncAlgorithm] | None:
        """The periodic sync algorithm `sync` names (engine/core/sync_algorithms.py); None for "allreduce"."""
        return parse_sync(self.sync, what="SyncPolicy.sync")

    @property
    def periodic(self) -> bool:
        """True for the low-communication modes: the replicas meet every sync_every steps, not every step."""
        return self.algorithm is not None

    def _check_sync(self) -> None:
        algorithm = self.algorithm  # ConfigError naming the choices for an unknown name
        if not isinstance(self.sync_every, int) or isinstance(self.sync_every, bool) or self.sync_every < 1:
            raise ConfigError(f"SyncPolicy.sync_every must be an int >= 1, got {self.sync_every!r}")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                f"SyncPolicy needs outer_lr > 0 and 0 <= outer_momentum < 1; got {self.outer_lr!r} and "
                f"{self.outer_momentum!r}"
            )
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"SyncPolicy.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.outer_momentum_warmup, int) or self.outer_momentum_warmup < 0:
            raise ConfigError(
                f"SyncPolicy.outer_momentum_warmup must be an int >= 0, got {self.outer_momentum_warmup!r}"
            )
        if not 0 <= self.mix < 1:
            raise ConfigError(f"SyncPolicy.mix must be in [0, 1), got {self.mix!r}")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ConfigError(f"SyncPolicy.fragments must be an int >= 1, got {self.fragments!r}")
        # fragments, fragment_delay and a quantized delta_dtype against the sync mode: the plan's (SyncPolicy's
        # run_settings; lockstep/plan.py), which also names an unknown delta_dtype
        self._check_delay(delayed=bool(algorithm and algorithm.delayed))

    def _check_delay(self, *, delayed: bool) -> None:
        delay = self.fragment_delay
        if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
            raise ConfigError(f"SyncPolicy.fragment_delay must be an int >= 0, got {delay!r}")
        if delayed and delay > self.sync_every:
            raise ConfigError(
                f"SyncPolicy.fragment_delay={delay} must be at most sync_every={self.sync_every}: a "
                "fragment's mean is applied before the fragment syncs again"
            )
