"""`accumulate()`: one step of K micro-batches over the ranks, by one driver with the reduction as a parameter.

A step is a global batch cut into K micro-batches of a fixed size (the caller cuts it; the ordinals
0..K-1 do not depend on the world size, only their owners do: rank r of W computes r, r + W, ... as
runtime.micro_batches assigns them). Live mode redoes a step over the survivors with the same global
batch cut into the same K micro-batches. Each micro-batch runs with everything that could depend on the
rank made a function of the micro-batch instead: its random numbers come from a seed of (seed, step,
ordinal), SyncBatchNorm uses the micro-batch's statistics and communicates nothing inside the step (so
ranks that own different numbers of micro-batches never wait on each other), and BatchNorm running
buffers are replayed in ordinal order (running_stats.py). The reduction is what differs, one per mode:

- `ExactReduction` (deterministic mode): every micro-batch's gradient joins an exact fixed-point sum
  (exact.py): the same bits at any world size. A micro-batch that overflows micro-batch 0's scale makes
  every rank redo the step at the agreed scale, so `fn` may run twice for a micro-batch.
- `FloatReduction` (the default policy): gradients are summed locally (no_sync) and reduced by the
  bucketed all-reduce of the rank's last backward, overlapped with it, like any DDP step; the engine
  averages over the W ranks, so the gradients are then scaled by W / K into the mean over the K
  micro-batches. The result differs from a run at another world size only by float rounding. Every
  rank needs a micro-batch (K >= W): its backward joins the all-reduce.

The averaged gradient is left in `.grad`, like a synced backward; the optimizer step is the caller's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine.deterministic.running_stats import RunningStats, micro_batch_statistics
from lockstep.errors import ConfigError, rank_tag
from lockstep.runtime.micro_batches import micro_batch_seed, owned_micro_batches


class MicroReduction(Protocol):
    """How a step's micro-batch gradients become their mean in `.grad` (one implementation per mode)."""

    def begin(self, num_micro_batches: int, maxima: torch.Tensor | None) -> None:
        """Before the step's micro-batches (again, with the agreed `maxima`, when the step is redone)."""
        ...

    def micro_batch(self, *, last: bool) -> AbstractContextManager[None]:
        """Around one micro-batch's forward and backward; `last`: this rank's last one of the step."""
        ...

    def reduce(self, num_micro_batches: int) -> torch.Tensor | None:
        """After them: None when `.grad` holds the mean, else the maxima to redo the step with."""
        ...

    def end(self) -> None:
        """After the step, done or failed."""
        ...


class MicroSteps:
    """Runs accumulate()'s steps for one replica: this rank's micro-batches, seeded, in order."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, *, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.running = RunningStats(module)
        self.steps = 0
        self.redos = 0  # steps run twice because a micro-batch overflowed micro-batch 0's scale
        self._cuda = cuda_devices(module)

    def owned(self, num_micro_batches: int) -> list[int]:
        return owned_micro_batches(num_micro_batches, self.world, self.rank)

    def run(
        self,
        reduction: MicroReduction,
        fn: Callable[[Any], Any],
        batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int,
    ) -> dict[int, Any]:
        owned = check_micro_batches(batches, num_micro_batches, step, rank=self.rank, world=self.world)
        maxima = None
        try:
            while True:
                reduction.begin(num_micro_batches, maxima)
                self.running.begin()
                results = {}
                for k in owned:
                    with reduction.micro_batch(last=k == owned[-1]):
                        results[k] = self._micro_batch(fn, batches[k], step, seed, k)
                maxima = reduction.reduce(num_micro_batches)
                if maxima is None:
                    break
                self.redos += 1
            self.running.finish(num_micro_batches, self.group)
        finally:
            reduction.end()
        self.steps += 1
        return results

    def _micro_batch(self, fn: Callable[[Any], Any], batch: Any, step: int, seed: int, ordinal: int) -> Any:
        with seeded(micro_batch_seed(seed, step, ordinal), self._cuda), micro_batch_statistics():
            self.running.ordinal = ordinal
            try:
                return fn(batch)
            finally:
                self.running.ordinal = None

    def remove(self) -> None:
        self.running.remove()


class ExactSums(Protocol):
    """What the exact reduction drives: the replicated engine's sums (exact.py) or a sharded model's
    (engine/sharded/exact_scatter.py)."""

    active: bool

    def begin(self, num_micro_batches: int, maxima: torch.Tensor | None = None) -> None: ...

    def start_micro_batch(self, *, last: bool) -> None: ...

    def end_micro_batch(self) -> None: ...

    def reduce(self) -> torch.Tensor | None: ...


class ExactReduction:
    """Deterministic mode's reduction: exact fixed-point sums (exact.py), the step redone on overflow."""

    def __init__(self, exact: ExactSums) -> None:
        self.exact = exact

    def begin(self, num_micro_batches: int, maxima: torch.Tensor | None) -> None:
        self.exact.begin(num_micro_batches, maxima)

    @contextmanager
    def micro_batch(self, *, last: bool) -> Iterator[None]:
        self.exact.start_micro_batch(last=last)
        yield
        self.exact.end_micro_batch()  # not after a micro-batch that raised: the step is abandoned

    def reduce(self, num_micro_batches: int) -> torch.Tensor | None:
        return self.exact.reduce()

    def end(self) -> None:
        self.exact.active = False


class FloatHost(Protocol):
    """What the float reduction needs of the replica (state.ReplicaState)."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def world(self) -> int: ...

    @property
    def tag(self) -> str:
        """The `[rank r/w] ` prefix of messages."""
        ...

    def broadcast_buffers_for_step(self) -> None:
        """The buffers broadcast once for the step, not by its forwards."""
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside keep their gradients local."""
        ...


class FloatReduction:
    """The default policy's reduction: each rank's local sum, all-reduced by its last backward, x W / K."""

    def __init__(self, replica: FloatHost) -> None:
        self.replica = replica

    def begin(self, num_micro_batches: int, maxima: torch.Tensor | None) -> None:
        world = self.replica.world
        if num_micro_batches < world:  # every rank knows K and W: all raise, none waits in an all-reduce
            raise ConfigError(
                f"{self.replica.tag}accumulate() with {num_micro_batches} micro-batches on {world} ranks: "
                "under the default policy every rank needs at least one (its backward joins the all-reduce); "
                "use more micro-batches per step, fewer ranks, or SyncPolicy(deterministic=True)"
            )
        self.replica.broadcast_buffers_for_step()

    def micro_batch(self, *, last: bool) -> AbstractContextManager[None]:
        # the last one's backward all-reduces the rank's summed gradients
        return contextlib.nullcontext() if last else self.replica.no_sync()

    def reduce(self, num_micro_batches: int) -> torch.Tensor | None:
        """The engine averaged the ranks' sums (/ W); x W / K makes it the mean over the K micro-batches."""
        scale = self.replica.world / num_micro_batches
        if scale != 1.0:
            with torch.no_grad():
                for p in self.replica.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        return None

    def end(self) -> None:
        pass


def cuda_devices(module: nn.Module) -> list[int]:
    """The CUDA devices of `module`'s parameters: their random streams are seeded per micro-batch too."""
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


@contextmanager
def seeded(seed: int, cuda: list[int]) -> Iterator[None]:
    """A micro-batch's own random stream; the caller's streams are untouched after it."""
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.manual_seed(seed)
        yield


def check_micro_batches(
    batches: Mapping[int, Any], num_micro_batches: int, step: int, *, rank: int, world: int
) -> list[int]:
    """This rank's ordinals of the step, once `batches` is known to hold exactly them (else ConfigError)."""
    tag = rank_tag(rank, world)
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ConfigError(f"{tag}num_micro_batches must be an int >= 1, got {num_micro_batches!r}")
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"{tag}step must be an int >= 0 (it seeds the step's random numbers), got {step!r}")
    owned = owned_micro_batches(num_micro_batches, world, rank)
    if sorted(batches) != owned:
        raise ConfigError(
            f"{tag}accumulate() got micro-batches {sorted(batches)!r} of {num_micro_batches}, expected this "
            f"rank's ordinals {owned!r} (rank r of W computes r, r + W, ...: handle.owned_micro_batches(K) "
            "says which; lockstep.data.MicroBatchSampler loads exactly those)"
        )
    return owned
