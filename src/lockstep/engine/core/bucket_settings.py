"""BucketSettings: SyncPolicy's knobs that the bucketed reducer reads (engine/buckets/), and nothing else.

SyncPolicy (policy.py) takes every knob as a keyword and builds this part from its bucket knobs, so the
reducer's modules import this module, not policy.py: they reach no periodic sync (engine/periodic/, the
algorithms, the wire formats). The messages name SyncPolicy, the class the user constructs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.errors import ConfigError

DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0
AUTO = "auto"  # bucket_cap_mb chosen by measurement (bucket_tuner.py)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class BucketSettings:
    """How gradients are bucketed: the meaning and default of each field is SyncPolicy's."""

    bucket_cap_mb: float | str = DEFAULT_BUCKET_CAP_MB
    first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    reduce_dtype: torch.dtype | None = None
    upcast_half_precision: bool = True
    torch_bucket_layout: bool = False

    def __post_init__(self) -> None:
        for name in ("bucket_cap_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if name == "bucket_cap_mb" and value == AUTO:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                also = " or 'auto'" if name == "bucket_cap_mb" else ""
                raise ConfigError(f"SyncPolicy.{name} must be a positive number of MiB{also}, got {value!r}")
        if self.reduce_dtype is not None and not (
            isinstance(self.reduce_dtype, torch.dtype) and self.reduce_dtype.is_floating_point
        ):
            raise ConfigError(
                f"SyncPolicy.reduce_dtype must be None or a floating torch.dtype, got {self.reduce_dtype!r}"
            )

    @property
    def tune_buckets(self) -> bool:
        """bucket_cap_mb="auto": the bucket tuner picks the cap (bucket_tuner.py)."""
        return self.bucket_cap_mb == AUTO

    @property
    def bucket_cap_bytes(self) -> int:
        """The cap in bytes ("auto": the default's, until the tuner chooses)."""
        cap = DEFAULT_BUCKET_CAP_MB if isinstance(self.bucket_cap_mb, str) else self.bucket_cap_mb
        return int(cap * 1024 * 1024)

    @property
    def first_bucket_bytes(self) -> int:
        # never above the cap: asking for small buckets gives a small first one too
        return min(int(self.first_bucket_mb * 1024 * 1024), self.bucket_cap_bytes)

    def bucket_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype in which gradients of `grad_dtype` are communicated."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return torch.float32 if grad_dtype in _LOW_PRECISION and self.upcast_half_precision else grad_dtype
