"""The memory of gradient buckets: flat buffers and views, per-step state, and what a hook receives.

bucket_layout.py decides which parameters share a bucket (a pure function of sizes, devices and dtypes);
this module holds each bucket's memory and per-step state for the reducer, and `GradBucket`, torch's
hook-facing bucket interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.buckets.bucket_layout import BucketSpec
from lockstep.runtime.progress import CollectiveRecord
from lockstep.torch_private import default_pg, in_coalescing

EAGER_COPY_MIN_NUMEL = 1 << 14  # below this mean size a bucket copies its gradients in one call


class Bucket:
    """The runtime side of a BucketSpec: parameters, flat buffer, views and this step's state."""

    def __init__(
        self, spec: BucketSpec, params: Sequence[torch.nn.Parameter], dtype: torch.dtype, last: bool
    ) -> None:
        self.index = spec.index
        self.indices = list(spec.param_indices)  # positions in registration order, in buffer order
        self.params = [params[i] for i in spec.param_indices]
        self.dtype, self.solo, self.sparse = dtype, spec.solo, spec.sparse
        numels = [p.numel() for p in self.params]
        total = sum(numels)
        # The last bucket carries one extra element: each rank's count of parameters without gradient,
        # summed by the same all-reduce, so that all ranks agree on errors without another collective.
        self.storage = (
            None if self.solo else torch.zeros(total + int(last), dtype=dtype, device=self.params[0].device)
        )
        self.buffer = self.storage[:total] if self.storage is not None else torch.empty(0, dtype=dtype)
        self.status = self.storage[total:] if self.storage is not None and last else None
        # the last element of what the built-in hook reduces (the status, or torch's layout's NaN flag)
        self.last_element = self.storage[-1] if self.storage is not None and self.storage.numel() else None
        self.views = [] if self.solo else flat_views(self.buffer, self.params)
        self.eager = not self.solo and total >= EAGER_COPY_MIN_NUMEL * len(numels)
        # bf16/fp16 grads in an fp32 bucket: scale after the copy, in fp32 (torch.mul(out=) would round
        # the scaled value in the gradient's dtype first). Buckets never mix dtypes: one test suffices.
        self.widen = dtype != self.params[0].dtype and dtype.itemsize >= self.params[0].dtype.itemsize
        # .grad and the views of one dtype: written back in one copy
        self.same_dtype = not self.solo and dtype == self.params[0].dtype
        self.nbytes = total * dtype.itemsize
        self.pending = len(self.params)
        self.last_ready = -1  # the parameter that completed it in the latest step (its trigger, reducer.py)
        self.future: torch.futures.Future[Any] | None = None
        self.written = False  # this step's averages are in .grad (set by write_back_bucket)
        self.hook_buffer = self.buffer
        self.t_launch = 0.0
        self.t_done = 0.0
        self.record: CollectiveRecord | None = None  # the hang watchdog's record of its latest launch

    def release(self) -> None:
        """The reducer built new buckets: let go of this one's memory now, whoever still holds the object
        (the watchdog's recent records, a reference cycle through its future). A gradient that is a view of
        it keeps the memory it views, as any tensor does."""
        self.storage = self.status = self.last_element = self.future = self.record = None
        self.buffer = self.hook_buffer = torch.empty(0, dtype=self.dtype, device=self.buffer.device)
        self.views = []


def empty_sparse_grad(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient with no rows, shaped like an embedding's (sparse over dim 0, dense after)."""
    indices = torch.empty((1, 0), dtype=torch.int64, device=p.device)
    values = torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape, device=p.device)


def flat_views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `params`, back to back (one split: 800 slices cost ~1 ms, not ~5)."""
    numels = [p.numel() for p in params]
    parts = torch.split(flat[: sum(numels)], numels)
    return [part.view(p.shape) for part, p in zip(parts, params)]


class GradBucket:
    """What a communication hook receives; the methods of torch.distributed.GradBucket."""

    def __init__(self, bucket: Bucket, num_buckets: int) -> None:
        self._bucket, self._num = bucket, num_buckets

    def buffer(self) -> torch.Tensor:
        return self._bucket.hook_buffer

    def index(self) -> int:
        return self._bucket.index

    def is_last(self) -> bool:
        return self._bucket.index == self._num - 1

    def gradients(self) -> list[torch.Tensor]:
        if self._bucket.sparse:
            return [self._bucket.hook_buffer]
        return flat_views(self._bucket.hook_buffer, self._bucket.params)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._bucket.hook_buffer = buffer

    get_per_parameter_tensors = gradients
    is_the_last_bucket_to_allreduce = is_last


def sum_hook(group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future[Any]:
    """The built-in hook: an async all-reduce (sum) of a bucket already scaled by 1/world on copy-in.

    A plain dense tensor goes to the process group's own allreduce, as torch's C++ reducer does: the
    checks of the `dist.all_reduce` wrapper (a dozen Python calls) cost more than the rest of a small
    bucket's launch and can never fail for a bucket. Anything else (a tensor subclass, a complex dtype,
    inside a coalescing context) takes `dist.all_reduce`, and so does every bucket while something has
    replaced `dist.all_reduce` (a profiler, a byte counter, lockstep.testing.watch_collectives)."""
    tensor = bucket.buffer()
    pg = group if group is not None else default_pg()
    if (
        dist.all_reduce is _ALL_REDUCE
        and pg is not None
        and type(tensor) is torch.Tensor
        and not tensor.is_complex()
        and not in_coalescing(pg)
    ):
        return pg.allreduce([tensor], _SUM_ASYNC).get_future()
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()  # type: ignore[union-attr]


_ALL_REDUCE = dist.all_reduce  # torch's own, as imported
_SUM_ASYNC = dist.AllreduceOptions()
_SUM_ASYNC.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch stubs: RedOpType
_SUM_ASYNC.asyncOp = True


def build_buckets(
    layout: Sequence[BucketSpec],
    params: Sequence[torch.nn.Parameter],
    dtypes: Sequence[torch.dtype],
    *,
    status: bool,
) -> tuple[list[Bucket], list[tuple[Bucket, int]]]:
    """The buckets of `layout` (`dtypes`: each parameter's bucket dtype) and, per parameter, its bucket and
    its position there. `status`: the last bucket carries the status element (lockstep's layout only)."""
    buckets = [
        Bucket(s, params, dtypes[s.param_indices[0]], status and s.index == len(layout) - 1) for s in layout
    ]
    where: list[tuple[Bucket, int]] = [None] * len(params)  # type: ignore[list-item]
    for b in buckets:
        for pos, i in enumerate(b.indices):
            where[i] = (b, pos)
    return buckets, where
