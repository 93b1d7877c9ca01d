"""Per-step timings and sizes of the engine, public (torch keeps them in private logging data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepStats:
    """One synced training step, as seen by this rank (times in milliseconds).

    - forward_ms: from the wrapper's pre-forward to the end of forward.
    - backward_ms: from the first gradient to the end of backward (the autograd engine's callback).
    - comm_ms: wall time during which at least one bucket's reduction was in flight. A reduction's end
      is observed, not called back (at the next bucket's launch, at the end of backward, or on waiting):
      an upper bound, exact for what backward() waited for.
    - comm_hidden_ms: the part of comm_ms that ran while backward was still computing (overlap);
      comm_ms - comm_hidden_ms is what backward() waited for at its end.
    - finalize_ms: the end-of-backward work: waits, the unused-parameter agreement, writing grads back.
    - bytes_communicated: bytes of bucket buffers handed to the communication hook. A compressing hook
      sends fewer: `lockstep.hooks.HookState` and `PowerSGDState` count what they really send (`.counter`).
    """

    step: int
    forward_ms: float
    backward_ms: float
    comm_ms: float
    comm_hidden_ms: float
    finalize_ms: float
    bytes_communicated: int

    @property
    def overlap(self) -> float:
        """Fraction of the communication hidden behind backward (0 when there was none)."""
        return self.comm_hidden_ms / self.comm_ms if self.comm_ms > 0 else 0.0


@dataclass(frozen=True)
class EngineStats:
    """What `handle.stats()` returns: the bucket layout, the last step and the mean over synced steps."""

    world_size: int
    num_parameters: int
    num_buckets: int
    bucket_sizes_bytes: list[int]
    bucket_num_params: list[int]
    buckets_rebuilt: bool
    synced_steps: int
    last: StepStats | None
    mean: StepStats | None
    extras: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("last", "mean"):
            step = getattr(self, key)
            if step is not None:
                out[key]["overlap"] = step.overlap
        return out


def union_ms(intervals: list[tuple[float, float]], until: float | None = None) -> float:
    """Total length (ms) of the union of [start, end] intervals (seconds), cut at `until` if given."""
    if len(intervals) == 1:  # the common case of a small model: one bucket
        start, end = intervals[0]
        if until is not None and until < end:
            end = until
        return (end - start) * 1000.0 if end > start else 0.0
    spans = sorted((s, min(e, until) if until is not None else e) for s, e in intervals)
    total = 0.0
    cur_start, cur_end = None, None
    for start, end in spans:
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total * 1000.0


class StatsRecorder:
    """Keeps the last step and running sums; cheap enough to stay on in every step (plain floats per
    step: the frozen StepStats is built only when someone reads `last`)."""

    def __init__(self) -> None:
        self._last: tuple[float, float, float, float, float, int] | None = None
        self._sums = [0.0] * 5
        self._bytes = 0
        self.steps = 0

    def record(
        self,
        forward_ms: float,
        backward_ms: float,
        comm_ms: float,
        hidden_ms: float,
        finalize_ms: float,
        nbytes: int,
    ) -> None:
        self._last = (forward_ms, backward_ms, comm_ms, hidden_ms, finalize_ms, nbytes)
        self.steps += 1
        sums = self._sums
        sums[0] += forward_ms
        sums[1] += backward_ms
        sums[2] += comm_ms
        sums[3] += hidden_ms
        sums[4] += finalize_ms
        self._bytes += nbytes

    @property
    def last(self) -> StepStats | None:
        """The latest synced step."""
        return StepStats(self.steps, *self._last) if self._last is not None else None

    @property
    def total_bytes(self) -> int:
        """Bytes handed to the communication hook over every synced step so far."""
        return self._bytes

    def mean(self) -> StepStats | None:
        if not self.steps:
            return None
        n = self.steps
        f, b, c, h, z = (s / n for s in self._sums)
        return StepStats(n, f, b, c, h, z, self._bytes // n)
