"""join()'s shadow step: a synced backward's collectives, with zeros, on a rank that ran out of inputs.

The mirror of launch + finalize on a training rank (reducer.py), in the same order: every bucket through
the communication hook (same sizes and dtypes, the status element included), then the unused-parameter
agreement, then the waits; if a training rank lacks gradients, the last bucket carries the same signal
here and this rank raises the same UnusedParameterError. Zeros leave the sums unchanged. join.py decides
when a rank shadows; the reducer's `shadow_backward` runs this in its SHADOWING phase.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.buckets.bucket_memory import Bucket, empty_sparse_grad
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import wait_tracked


def mirror_backward(
    buckets: Sequence[Bucket],
    call_hook: Callable[[Bucket], torch.futures.Future[Any]],
    *,
    op: str,
    group: dist.ProcessGroup | None,
    with_status: bool,
    agree: Callable[[], str | None],
    read_signal: Callable[[torch.Tensor], str],
) -> str:
    """Launch zeros for every bucket, agree on unused parameters, wait; the verdict ('' if all is well).

    `op`: how the hang watchdog names a bucket's collective; `with_status`: the built-in hook sends the
    last bucket's status element too; `agree`: the unused-parameter agreement (None: the training ranks'
    signal travelled in the last bucket, `read_signal` reads it from the reduced buffer).
    """
    launched = []
    for b in buckets:
        b.hook_buffer = _shadow_buffer(b, with_status=with_status)
        record = PROGRESS.issue(op, (b.hook_buffer,), group)
        record.work = call_hook(b)
        launched.append(record)
    verdict = agree()
    values = [wait_tracked(record, record.work) for record in launched]
    for b in buckets:
        b.hook_buffer = b.buffer
    if verdict is None:  # the training ranks' signal travelled in the last bucket
        last = values[-1][0] if isinstance(values[-1], list) else values[-1]
        verdict = read_signal(last)
    return verdict


def _shadow_buffer(b: Bucket, *, with_status: bool) -> torch.Tensor:
    """Zeros shaped as what a training rank hands the hook for bucket b (see the reducer's launch)."""
    p = b.params[0]
    if b.sparse:
        return empty_sparse_grad(p)
    if b.solo:
        return torch.zeros(p.numel(), dtype=b.dtype, device=p.device)
    zeros = torch.zeros_like(b.storage)  # type: ignore[arg-type]  # only solo buckets have none
    return zeros if b.status is not None and with_status else zeros[: b.buffer.numel()]
