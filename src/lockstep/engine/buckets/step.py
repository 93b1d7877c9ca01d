"""One backward's bookkeeping: which parameters are ready, which bucket launches next, what it cost.

A `StepState` exists only while a real backward of the engine runs: the reducer creates it when the
first parameter of an armed forward accumulates its gradient into `.grad`, and drops it in finalize.
Calls of `torch.autograd.grad` (gradient penalties, meta-learning) never accumulate into `.grad`, so
they never create one: the engine stays armed for the backward that follows, as torch's DDP does.

`ParamStepper` is who steps the parameters during a step: the small interface the reducer is handed (it
imports no optimizer module). `NoStepper` (the default) steps nothing: the user's optimizer steps after
backward. optimizer_steps.py's `OverlappedSteps` steps each bucket as soon as its averages are back, over
an OverlappedOptimizer of whole parameters or of this rank's share (engine/replica/mode.py builds it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lockstep.engine.buckets.bucket_memory import Bucket


class StepState:
    """Per-backward state of the reducer (the layout and the launch/wait logic live in reducer.py)."""

    __slots__ = ("ready", "next_bucket", "bytes_sent", "hits", "defer", "t_backward", "missing_count")

    def __init__(self, num_params: int, *, count_hits: bool, defer: bool) -> None:
        self.ready = bytearray(num_params)  # 1 once parameter i's gradient is in its bucket
        self.next_bucket = 0  # buckets launch strictly in order: the next one to launch
        self.bytes_sent = 0  # gradient payload handed to the communication hook
        self.hits: list[int] | None = [0] * num_params if count_hits else None  # static_graph's counts
        self.defer = defer  # static_graph's first step: reduce everything at the end
        self.t_backward = time.perf_counter()
        self.missing_count = 0  # parameters without gradient, filled in by finalize

    def missing(self) -> list[int]:
        """Parameters that got no gradient in this backward (indices)."""
        if 0 not in self.ready:
            return []
        return [i for i, flag in enumerate(self.ready) if not flag]


class ArmedForward:
    """What a synced forward leaves for the backward that follows it (torch's prepare_for_backward)."""

    __slots__ = ("unused", "t_start", "t_end")

    def __init__(self, unused: list[int], t_start: float) -> None:
        self.unused = unused  # this rank's parameters not reached from the outputs (find_unused_parameters)
        self.t_start, self.t_end = t_start, time.perf_counter()


class ParamStepper(Protocol):
    """What the reducer calls at four points of its phases (optimizer_steps.py says what each does)."""

    def begin(self, unused: Sequence[int], where: Sequence[tuple[Bucket, int]]) -> None:
        """A synced backward starts (ARMED -> REDUCING); `unused`: parameters its forward did not reach."""
        ...

    def poll(self, buckets: Sequence[Bucket], launched: int, write_back: Callable[[Bucket], None]) -> None:
        """During backward, after a launch: buckets whose reduction came back may step."""
        ...

    def reduced(self, b: Bucket, *, last: bool) -> None:
        """In finalize: bucket b was waited for and written back."""
        ...

    def end(self, buckets: Sequence[Bucket], *, ok: bool) -> None:
        """finalize knows whether the step stands (`ok`: no error from the missing-gradient verdict)."""
        ...

    def suspended(self, reason: str) -> AbstractContextManager[None]:
        """The synced backwards inside step nothing in the engine (accumulate())."""
        ...

    def stats(self) -> dict[str, Any]:
        """For EngineStats.extras."""
        ...


class NoStepper:
    """The default: the engine never steps the optimizer."""

    def begin(self, unused: Sequence[int], where: Sequence[tuple[Bucket, int]]) -> None:
        pass

    def poll(self, buckets: Sequence[Bucket], launched: int, write_back: Callable[[Bucket], None]) -> None:
        pass

    def reduced(self, b: Bucket, *, last: bool) -> None:
        pass

    def end(self, buckets: Sequence[Bucket], *, ok: bool) -> None:
        pass

    @contextmanager
    def suspended(self, reason: str) -> Iterator[None]:
        yield

    def stats(self) -> dict[str, Any]:
        return {}
