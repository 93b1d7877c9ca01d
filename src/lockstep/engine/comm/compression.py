"""Communication hooks with torch's contract: plain all-reduce and half-precision compression, byte-counted.

A hook is `hook(state, bucket) -> torch.futures.Future[torch.Tensor]`: `bucket` is a torch
`dist.GradBucket` (or lockstep's engine bucket, which has the same methods) whose `buffer()` holds the
flat, unaveraged gradients of this rank; the future's value is that buffer averaged over the group. The
hooks here register unchanged on `torch.nn.parallel.DistributedDataParallel` and on lockstep's engine.

`state` is what torch passes to its stateless hooks (a ProcessGroup, or None for the default group), or a
`HookState`, which adds a `BytesCounter` (what this rank handed to collectives, per step) and the choice
of how half-precision payloads are summed.

Half precision. The gradients are divided by the world size in the bucket's own dtype (fp32 as a rule)
and rounded once to fp16/bf16: dividing first keeps an fp16 sum of N ranks from overflowing (a value
that survives the cast cannot grow past the fp16 range when N averaged values are added), at the price
of flushing gradients below about 6e-8*N to zero, which fp16 could not carry anyway. By default the
payloads are all-reduced natively in half precision (gloo has reduced fp16 and bf16 on CPU since torch
2.x; nccl always has): the payload is half the bytes of fp32, and the partial sums are rounded to half
precision. With `HookState(sum_in_fp32=True)`, or when the backend refuses the dtype, each rank instead
all-gathers the undivided half payloads and sums them in fp32: the sum is exact up to one fp32 rounding,
the payload is still half of fp32's, and on 2 ranks the wire bytes equal a ring all-reduce's
(each rank sends its payload once), but for N ranks an all-gather sends (N-1)x the payload where a ring
all-reduce sends 2(N-1)/N x, so beyond 3 ranks it moves more bytes than the fp32 all-reduce it replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import CommHookTypeError

HookFuture = torch.futures.Future[torch.Tensor]


class BytesCounter:
    """Payload bytes this rank hands to the collectives of one hook, in total and per training step.

    A payload is the tensor this rank contributes: the whole tensor for an all-reduce, this rank's part
    for an all-gather. (On the wire a ring all-reduce sends 2(N-1)/N of its payload per rank, an
    all-gather (N-1)x; both are 1x on 2 ranks.) A step ends when the hook has handled the last bucket.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total_bytes = 0
        self.num_collectives = 0
        self.num_steps = 0
        self.last_step_bytes = 0
        self.step_bytes: list[int] = []  # one entry per completed step
        self._current = 0

    def add(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.total_bytes += nbytes
        self._current += nbytes
        self.num_collectives += 1

    def end_step(self) -> None:
        self.last_step_bytes, self._current = self._current, 0
        self.step_bytes.append(self.last_step_bytes)
        self.num_steps += 1

    @property
    def bytes_per_step(self) -> float:
        """Mean payload bytes per completed step (0.0 before the first)."""
        return self.total_bytes / self.num_steps if self.num_steps else 0.0

    def __repr__(self) -> str:
        return (
            f"BytesCounter(total_bytes={self.total_bytes}, num_steps={self.num_steps}, "
            f"last_step_bytes={self.last_step_bytes}, num_collectives={self.num_collectives})"
        )


class HookState:
    """State for the stateless hooks: the process group, a byte counter, how half payloads are summed.

    `ddp.register_comm_hook(HookState(group), fp16_compress_hook)` behaves like torch's
    `register_comm_hook(group, fp16_compress_hook)` and counts what it sends in `state.counter`.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, sum_in_fp32: bool = False) -> None:
        self.process_group = process_group
        self.sum_in_fp32 = bool(sum_in_fp32)
        self.counter = BytesCounter()

    @property
    def bytes_communicated(self) -> int:
        """Payload bytes handed to collectives so far (see BytesCounter)."""
        return self.counter.total_bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(process_group={self.process_group!r}, counter={self.counter!r})"


# ---------------------------------------------------------------- helpers shared by every hook


def group_of(state: Any) -> dist.ProcessGroup | None:
    """The process group a hook state names: a HookState's, a ProcessGroup itself, or None (default)."""
    if isinstance(state, HookState):
        return state.process_group
    if state is None or isinstance(state, dist.ProcessGroup):
        return state
    raise CommHookTypeError(
        f"a communication hook's state must be a ProcessGroup, None or a lockstep HookState, got "
        f"{type(state).__name__} {state!r}; register the hook as ddp.register_comm_hook(None, hook) or "
        f"ddp.register_comm_hook(lockstep.hooks.HookState(group), hook)"
    )


def world_of(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def count(state: Any, tensor: torch.Tensor) -> None:
    """Add a payload to the state's counter, if it has one (torch's plain states do not)."""
    if isinstance(state, HookState):
        state.counter.add(tensor)


def end_bucket(state: Any, bucket: Any) -> None:
    """Close the step in the state's counter after the last bucket."""
    if isinstance(state, HookState) and bucket.is_last():
        state.counter.end_step()


def all_reduce_future(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> HookFuture:
    """Async sum of `tensor` in place; the future's value is `tensor` (torch's value is a list)."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])  # type: ignore[union-attr]


def torch_signature(hook: Callable[..., HookFuture]) -> Callable[..., HookFuture]:
    """Give a hook the annotations that torch's register_comm_hook insists on.

    torch compares the `bucket` and return annotations with `dist.GradBucket` and
    `torch.futures.Future[torch.Tensor]`; postponed annotations are strings and would be refused.
    """
    hook.__annotations__ = {
        **hook.__annotations__,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


# ---------------------------------------------------------------- the hooks


@torch_signature
def allreduce_hook(state: Any, bucket: Any) -> HookFuture:
    """Average the bucket over the group with one async all-reduce (the same numbers as no hook).

    Drop-in for torch's `default_hooks.allreduce_hook`: `state` is a ProcessGroup or None, or a
    HookState to count bytes. Divides before summing, like torch's reducer, so the result is bitwise
    that of DDP without a hook.
    """
    group = group_of(state)
    buffer = bucket.buffer()
    buffer.div_(world_of(group))
    count(state, buffer)
    fut = all_reduce_future(buffer, group)
    end_bucket(state, bucket)
    return fut


@torch_signature
def fp16_compress_hook(state: Any, bucket: Any) -> HookFuture:
    """Communicate in fp16 (half the bytes of fp32), average, and decompress into the bucket's dtype."""
    return _half_hook(torch.float16, state, bucket)


@torch_signature
def bf16_compress_hook(state: Any, bucket: Any) -> HookFuture:
    """Communicate in bf16 (half the bytes of fp32; fp32's range), average, decompress into the bucket's dtype."""
    return _half_hook(torch.bfloat16, state, bucket)


# torch's DDP refuses a hook *named* bf16_compress_hook unless CUDA and NCCL >= 2.10 are there; ours
# works on gloo and CPU, so it goes by another __name__ (the public name stays bf16_compress_hook).
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "lockstep_bf16_compress_hook"


def _half_hook(dtype: torch.dtype, state: Any, bucket: Any) -> HookFuture:
    group = group_of(state)
    buffer = bucket.buffer()
    if isinstance(state, HookState) and state.sum_in_fp32:
        fut = _gather_sum(dtype, state, buffer, group)
    else:
        fut = _native_half(dtype, state, buffer, group)
    end_bucket(state, bucket)
    return fut


def _native_half(
    dtype: torch.dtype, state: Any, buffer: torch.Tensor, group: dist.ProcessGroup | None
) -> HookFuture:
    buffer.div_(
        world_of(group)
    )  # in the bucket's dtype, then one rounding to half (see the module docstring)
    payload = buffer.to(dtype)
    try:
        work = dist.all_reduce(payload, group=group, async_op=True)
    except RuntimeError as exc:
        if not _refused_dtype(exc):
            raise
        # This backend cannot sum `dtype` (gloo before bf16 support): every rank gets the same refusal,
        # so every rank takes the same fallback and the collectives still pair up.
        buffer.mul_(world_of(group))
        return _gather_sum(dtype, state, buffer, group)
    count(state, payload)

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raises a failed all-reduce
        return buffer.copy_(payload)

    return work.get_future().then(decompress)  # type: ignore[union-attr]


def _gather_sum(
    dtype: torch.dtype, state: Any, buffer: torch.Tensor, group: dist.ProcessGroup | None
) -> HookFuture:
    """All-gather the undivided half payloads; sum them in fp32 and divide once (see the module docstring)."""
    world = world_of(group)
    payload = buffer.to(dtype)
    gathered = torch.empty((world, payload.numel()), dtype=dtype, device=payload.device)
    work = dist.all_gather(list(gathered.unbind(0)), payload, group=group, async_op=True)
    count(state, payload)

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()
        total = gathered.to(torch.float32).sum(dim=0)
        return buffer.copy_(total.div_(world))

    return work.get_future().then(decompress)  # type: ignore[union-attr]


def _refused_dtype(exc: RuntimeError) -> bool:
    text = str(exc).lower()
    return "scalar type" in text or "dtype" in text or "unsupported" in text or "not supported" in text
