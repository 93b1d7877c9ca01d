"""Deterministic mode's sampler: each step's global batch cut into fixed micro-batches, the same at any world size.

Positions of an epoch follow DistributedSampler's global order (torch's randperm of seed + epoch). Step i
covers positions [i*S, (i+1)*S) with S = num_micro_batches * micro_batch_size; micro-batch k of the step
is the k-th run of micro_batch_size positions in it. Rank r of W loads the micro-batches that
runtime.micro_batches assigns it (r, r + W, ...), the ones the engine's accumulate() expects. So which
samples form micro-batch k of step i depends on (seed, epoch, i, k) only: never on the world size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import Sampler

from lockstep.data.sampler import STATE_VERSION, check_saved_state, epoch_order, resolve_replicas
from lockstep.errors import ConfigError, rank_tag
from lockstep.runtime.micro_batches import owned_micro_batches


class MicroBatchSampler(Sampler[list[int]]):
    """A batch sampler (DataLoader(batch_sampler=...)) yielding this rank's micro-batches, step by step.

    With drop_last (the default) an epoch has len(dataset) // S whole steps; without it a last, shorter
    step follows, cut into micro-batches the same way (its last one shorter). `state_dict()` holds the
    epoch and the global positions consumed, as DistributedSampler's does: the training loop calls
    `advance(samples)` after each step (every rank, the global count), and a sampler loaded from that
    state at any world size continues at the next step.
    """

    def __init__(
        self,
        dataset: Sized,
        micro_batch_size: int,
        num_micro_batches: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        for name, value in (("micro_batch_size", micro_batch_size), ("num_micro_batches", num_micro_batches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"MicroBatchSampler: {name} must be an int >= 1, got {value!r}")
        self.dataset = dataset
        self.micro_batch_size, self.num_micro_batches = micro_batch_size, num_micro_batches
        self.num_replicas, self.rank = resolve_replicas(num_replicas, rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self._start = 0  # position where the next iteration begins (a loaded resume position, else 0)
        self._started = False
        self._advanced = 0

    @property
    def step_size(self) -> int:
        """Samples per step, over all ranks: the global batch."""
        return self.micro_batch_size * self.num_micro_batches

    def _end(self, start: int) -> int:
        size = len(self.dataset)
        if not self.drop_last:
            return max(size, start)
        return start + max(size - start, 0) // self.step_size * self.step_size

    def num_steps(self) -> int:
        """Steps of the iteration under way (from where it began), or else of the next one."""
        return -(-(self._end(self._start) - self._start) // self.step_size)

    def set_epoch(self, epoch: int) -> None:
        """The next iteration runs `epoch` (from the loaded resume position when a loaded state is inside it)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"set_epoch expects an int >= 0, got {epoch!r}")
        if epoch != self.epoch or self._started:
            self._start = 0
        self.epoch, self._started = epoch, False

    def __iter__(self) -> Iterator[list[int]]:
        if self._started:
            self._start = 0  # another iteration of the same epoch: from its beginning
        self._started, self._advanced = True, 0
        order = epoch_order(len(self.dataset), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        return iter(self._micro_batches(order, self._start, self._end(self._start)))

    def _micro_batches(self, order: list[int], start: int, end: int) -> list[list[int]]:
        batches = []
        for step_start in range(start, end, self.step_size):
            step_end = min(step_start + self.step_size, end)
            count = -(-(step_end - step_start) // self.micro_batch_size)
            for k in owned_micro_batches(count, self.num_replicas, self.rank):
                first = step_start + k * self.micro_batch_size
                batches.append(order[first : min(first + self.micro_batch_size, step_end)])
        return batches

    def __len__(self) -> int:
        """Micro-batches this rank yields in a whole iteration from the current start."""
        order = list(range(len(self.dataset)))
        return len(self._micro_batches(order, self._start, self._end(self._start)))

    def advance(self, num_global_samples: int) -> None:
        """The loop trained `num_global_samples` more samples of this epoch (summed over ranks)."""
        if not isinstance(num_global_samples, int) or num_global_samples < 0:
            raise ConfigError(
                f"advance expects an int >= 0 (samples summed over ranks), got {num_global_samples!r}"
            )
        if num_global_samples and not self._started:
            raise ConfigError(
                f"{self._tag()}advance({num_global_samples}) before the epoch's iterator was created"
            )
        if self._start + self._advanced + num_global_samples > self._end(self._start):
            raise ConfigError(
                f"{self._tag()}advance({num_global_samples}) goes past the end of epoch {self.epoch}: "
                f"{self._start + self._advanced} of {self._end(self._start)} positions were consumed already"
            )
        self._advanced += num_global_samples

    def state_dict(self) -> dict[str, Any]:
        """The epoch to continue and its global positions consumed (DistributedSampler's format)."""
        epoch, consumed = self.epoch, self._start + (self._advanced if self._started else 0)
        if self._started and consumed >= self._end(self._start):
            epoch, consumed = epoch + 1, 0
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "num_consumed": consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` stopped, at any world size."""
        epoch, consumed = check_saved_state(
            state,
            dataset_len=len(self.dataset),
            seed=self.seed,
            shuffle=self.shuffle,
            tag=self._tag(),
            kind="MicroBatchSampler",
        )
        if consumed >= len(self.dataset) or self._end(consumed) == consumed:
            epoch, consumed = epoch + 1, 0
        self.epoch, self._start, self._started, self._advanced = epoch, consumed, False, 0

    def _tag(self) -> str:
        return rank_tag(self.rank, self.num_replicas) if self.num_replicas > 1 else ""
