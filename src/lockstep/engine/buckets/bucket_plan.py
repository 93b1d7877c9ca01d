"""Which buckets the reducer uses: lockstep's assignment or torch's, at construction and at the rebuild.

bucket_layout.py assigns buckets from parameter specs (pure); this module describes the reducer's
parameters once and asks for a layout in the way the settings say: lockstep's own rules, or, for the
drop-in class (SyncPolicy.torch_bucket_layout), torch's own assignment function called as torch's
DistributedDataParallel calls it, so that ring all-reduces sum the same elements in the same order.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from lockstep.engine.buckets.bucket_layout import (
    BucketSpec,
    ParamSpec,
    assign_buckets,
    specs_from_index_lists,
)
from lockstep.engine.core.bucket_settings import BucketSettings
from lockstep.torch_private import compute_bucket_assignment_by_size


class BucketPlanner:
    """The bucket layouts of one reducer's parameters under one policy (its BucketSettings)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        sparse: Sequence[bool],
        settings: BucketSettings,
    ) -> None:
        self.params, self.sparse, self.settings = list(params), list(sparse), settings
        self.dtypes = [settings.bucket_dtype(p.dtype) for p in self.params]  # each parameter's bucket dtype
        self.specs = [  # parameters never change: described once
            ParamSpec(name, p.numel(), p.numel() * dtype.itemsize, str(p.device), str(p.dtype), sparse=s)
            for name, p, s, dtype in zip(names, self.params, self.sparse, self.dtypes)
        ]
        self.cap_bytes = settings.bucket_cap_bytes  # what layouts use from now on (the tuner changes it)

    def layout(
        self,
        order: Sequence[int] | None,
        *,
        static_graph: bool,
        solo_bytes: int | None,
        cap_bytes: int | None = None,
    ) -> list[BucketSpec]:
        """The buckets in launch order: at construction (`order` None) or in rank 0's observed ready order.
        `cap_bytes`: another cap than the settings' (the bucket tuner's candidates; lockstep's layout only)."""
        settings = self.settings
        if settings.torch_bucket_layout:
            return specs_from_index_lists(self.specs, self._torch_index_lists(order, static_graph))
        cap = self.cap_bytes if cap_bytes is None else cap_bytes
        return assign_buckets(
            self.specs,
            cap_bytes=cap,
            first_cap_bytes=min(settings.first_bucket_bytes, cap),
            order=order,
            solo_bytes=solo_bytes,
        )

    def skips_rebuild(self, *, static_graph: bool) -> bool:
        """torch never rebuilds its buckets with find_unused_parameters (unless the graph is static)."""
        return self.settings.torch_bucket_layout and self.settings.find_unused_parameters and not static_graph

    def _torch_index_lists(self, order: Sequence[int] | None, static_graph: bool) -> list[list[int]]:
        """torch's buckets, from torch's own assignment function, as DistributedDataParallel calls it."""
        first, cap = self.settings.first_bucket_bytes, self.settings.bucket_cap_bytes
        assign = compute_bucket_assignment_by_size
        tensors: list[torch.Tensor] = list(self.params)
        if order is None:  # construction: all in one bucket unless unused parameters are searched for
            one_bucket = static_graph or not self.settings.find_unused_parameters
            limits = [sys.maxsize] if one_bucket else [first, cap] if first < cap else [cap]
            lists, _ = assign(tensors, limits, self.sparse)
            return list(reversed(lists))  # launch order: the last parameters' gradients come first
        lists, _ = assign([tensors[i] for i in order], [first, cap], self.sparse, list(order))
        return lists  # the rebuild: already in ready order
