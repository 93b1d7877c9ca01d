"""Shard each epoch's sample order across ranks so that it depends only on (seed, epoch) and resumes exactly.

The invariants are in DistributedSampler's docstring; the pure functions below compute them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from lockstep.errors import ConfigError, rank_tag
from lockstep.runtime import get_rank, get_world_size

STATE_VERSION = 1


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The global order of one epoch: torch's randperm seeded with seed + epoch (or range without shuffle)."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def epoch_end(num_samples: int, *, num_replicas: int, start: int, drop_last: bool) -> int:
    """The position where an epoch resumed at `start` ends for `num_replicas` ranks (invariant 3)."""
    remaining = max(num_samples - start, 0)
    per_rank = remaining // num_replicas if drop_last else math.ceil(remaining / num_replicas)
    return start + per_rank * num_replicas


def shard_indices(
    order: list[int], *, num_replicas: int, rank: int, start: int, drop_last: bool
) -> list[int]:
    """This rank's dataset indices for an epoch resumed at `start` (invariant 2)."""
    end = epoch_end(len(order), num_replicas=num_replicas, start=start, drop_last=drop_last)
    return [order[position % len(order)] for position in range(start + rank, end, num_replicas)]


def resolve_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(num_replicas, rank) as given, or from the process group (a world of 1 without one); checked."""
    num_replicas = get_world_size() if num_replicas is None else num_replicas
    rank = get_rank() if rank is None else rank
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError(
            f"num_replicas must be an int >= 1, got {num_replicas!r}; pass the world size, or leave "
            "it None to take it from the process group"
        )
    if not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ConfigError(
            f"rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, got {rank!r}; "
            "pass this process's rank, or leave it None to take it from the process group"
        )
    return num_replicas, rank


def check_saved_state(
    state: Any, *, dataset_len: int, seed: int, shuffle: bool, tag: str, kind: str = "DistributedSampler"
) -> tuple[int, int]:
    """(epoch, num_consumed) of a saved sampler state, checked against the sampler that loads it."""
    if not isinstance(state, dict) or not {"epoch", "num_consumed"} <= set(state):
        raise ConfigError(f"{tag}a {kind} state needs 'epoch' and 'num_consumed', got {state!r}")
    epoch, consumed = state["epoch"], state["num_consumed"]
    if not isinstance(epoch, int) or epoch < 0 or not isinstance(consumed, int) or consumed < 0:
        raise ConfigError(
            f"{tag}sampler state has epoch={epoch!r}, num_consumed={consumed!r}; expected ints >= 0"
        )
    for key, mine in (("dataset_len", dataset_len), ("seed", seed), ("shuffle", shuffle)):
        if key in state and state[key] != mine:
            raise ConfigError(
                f"{tag}the sampler state was saved with {key}={state[key]!r} but this sampler has "
                f"{key}={mine!r}; the resumed order would not continue the saved one. Build the sampler "
                f"with {key}={state[key]!r} (and the same dataset) or start a fresh run"
            )
    return epoch, consumed


class DistributedSampler(Sampler[int]):
    """Drop-in for torch.utils.data.DistributedSampler whose order does not depend on the world size.

    Same arguments as torch's; `num_replicas` and `rank` default to lockstep's process group (a world
    of 1 without one). Under torch's name it yields torch's order for any sequence of `set_epoch()` calls,
    none included. Adds: `state_dict()` / `load_state_dict()` for an exact mid-epoch resume at any world
    size, `advance()` for loaders that prefetch, and a one-time warning when an epoch number is repeated.

    Invariants (tests/unit/test_sampler.py pins each one):

    1. The epoch's global order is `torch.randperm(len(dataset))` drawn from a generator seeded with
       `seed + epoch` (or `range(len)` without shuffle): torch's own order, whatever the world size.
    2. Position p of the epoch's sequence is `order[p % len(dataset)]` (positions past the end wrap: that is
       torch's padding). Rank r of N takes positions start + r, start + r + N, ... below the epoch's end, so
       with per-rank batch b the i-th global batch is positions `[i*N*b, (i+1)*N*b)`: the same samples for
       every N with the same `N*b`. A fresh epoch (start 0) yields exactly what torch's sampler yields, and
       `len()` is then torch's `num_samples`.
    3. The end of an epoch that starts at position `start` is `start + ceil(remaining / N) * N` (padding by
       wrapping, as torch) or, with drop_last, `start + floor(remaining / N) * N` (the tail is dropped),
       where remaining = len(dataset) - start.
    4. `state_dict()` is plain JSON: the epoch and `num_consumed`, the global number of positions of that
       epoch already consumed: (epoch, resume position) before the epoch's iteration starts, (epoch,
       consumed) while it runs, and (epoch + 1, 0) once it has consumed the epoch's end (the loop's next
       epoch). A sampler loaded from it, at any world size, continues at position `num_consumed`: exactly
       the samples not yet seen. When the remaining count does not divide by the new world size, padding or
       drop_last applies to the remainder only.
    5. By default `num_consumed` = start + (indices this rank's iterator has yielded) * N. A DataLoader with
       workers prefetches, so it pulls indices before the loop sees them: the loop then calls
       `advance(num_global_samples)` after each step (once called, the state counts only what was
       advanced; call `advance(0)` up front to use that mode from the first batch on).
    6. `iter()` never changes `epoch`: every iteration runs epoch `self.epoch`, as torch's does, until
       `set_epoch()` or `load_state_dict()` names another. The first iteration after `load_state_dict()`
       (kept by `set_epoch(e)` with e the loaded epoch) starts at the loaded resume position; any further
       iteration of that epoch starts at position 0, as torch. When an iteration yields the last index of
       an epoch whose previous full pass had the same epoch number (set_epoch forgotten or repeated), rank 0
       warns once per sampler, with shuffle only: the order is torch's, only the warning is added. A
       partial iteration (peeking at one batch) is not a pass, so torch's tutorials never warn.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.dataset = dataset
        self.num_replicas, self.rank = resolve_replicas(num_replicas, rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self._start = 0  # where the next iteration of self.epoch begins (a loaded resume position, else 0)
        self._started = False  # an iteration began since set_epoch/load_state_dict: the next one starts at 0
        self._end = 0  # end position of the iteration in progress
        self._yielded = 0
        self._advanced = 0
        self._explicit = False  # advance() was called: count what the loop consumed, not what was yielded
        self._token = 0  # identifies the live iterator; older ones stop counting
        self._last_pass: int | None = None  # epoch number of the last iteration that yielded all its indices
        self._warned = False  # the repeated-epoch warning was given (once per sampler)

    # ---- torch's interface ----------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Indices per rank in a fresh epoch (torch's attribute)."""
        return self._length(0)

    @property
    def total_size(self) -> int:
        """Indices over all ranks in a fresh epoch, padding included (torch's attribute)."""
        return self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """The next iter() runs `epoch` (from its resume position when a loaded state is inside it)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"set_epoch expects an int >= 0, got {epoch!r}")
        if epoch != self.epoch or self._started:
            self._start = 0
        self.epoch, self._started = epoch, False

    def __len__(self) -> int:
        """Indices this rank yields in the iteration in progress, or else in the next one."""
        if self._started and self._consumed() < self._end:
            return (self._end - self._start) // self.num_replicas
        return self._length(0 if self._started else self._start)

    def __iter__(self) -> Iterator[int]:
        """This rank's indices of epoch `self.epoch`; never changes the epoch (torch's behaviour)."""
        if self._started:
            self._start = 0  # another iteration of the same epoch: from its beginning, as torch
        self._started, self._yielded, self._advanced = True, 0, 0
        self._token += 1
        size = len(self.dataset)
        self._end = epoch_end(
            size, num_replicas=self.num_replicas, start=self._start, drop_last=self.drop_last
        )
        order = epoch_order(size, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        indices = shard_indices(
            order, num_replicas=self.num_replicas, rank=self.rank, start=self._start, drop_last=self.drop_last
        )
        return self._count(indices, self._token)

    # ---- lockstep's additions -------------------------------------------------------------------------

    def advance(self, num_global_samples: int) -> None:
        """The training loop consumed `num_global_samples` more samples of this epoch, summed over ranks.

        From the first call on, state_dict() counts advanced samples instead of yielded indices: the
        right count when a DataLoader with workers prefetches. Samples a DataLoader drops (its own
        drop_last) are never advanced, so a resumed epoch offers them again.
        """
        if not isinstance(num_global_samples, int) or num_global_samples < 0:
            raise ConfigError(
                f"advance expects an int >= 0 (samples summed over ranks), got {num_global_samples!r}"
            )
        self._explicit = True
        if num_global_samples == 0:
            return
        if not self._started:
            raise ConfigError(
                f"{self._tag()}advance({num_global_samples}) was called before the epoch's iterator "
                "was created; call it after the loop consumed a batch"
            )
        if self._start + self._advanced + num_global_samples > self._end:
            raise ConfigError(
                f"{self._tag()}advance({num_global_samples}) goes past the end of epoch {self.epoch}: "
                f"{self._start + self._advanced} of {self._end} positions were consumed already; pass the "
                "number of samples of this step summed over all ranks (per-rank batch * world size)"
            )
        self._advanced += num_global_samples

    @property
    def num_consumed(self) -> int:
        """Global positions of the current epoch already consumed (see the module's invariant 5)."""
        return self._consumed() if self._started else self._start

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON data: the epoch to continue and the global number of its samples already consumed.

        Before the epoch's iteration starts: (epoch, its resume position). While it runs: (epoch, samples
        consumed). Once it consumed the epoch's end: (epoch + 1, 0), the epoch a training loop goes on with.
        """
        epoch, consumed = self.epoch, self.num_consumed
        if self._started and consumed >= self._end:
            epoch, consumed = epoch + 1, 0  # the epoch is done: resume with the next one
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "num_consumed": consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue where `state_dict` stopped: at the same or another world size, the unseen samples next."""
        epoch, consumed = self._check_state(state_dict)
        size = len(self.dataset)
        end = epoch_end(size, num_replicas=self.num_replicas, start=consumed, drop_last=self.drop_last)
        if consumed >= size or end == consumed:
            epoch, consumed = epoch + 1, 0  # nothing of that epoch is left at this world size
        self.epoch, self._start, self._started = epoch, consumed, False
        self._yielded = self._advanced = 0

    # ---- internals ------------------------------------------------------------------------------------

    def _count(self, indices: list[int], token: int) -> Iterator[int]:
        if not indices and token == self._token:
            self._finish_pass()
        for index in indices:
            if token == self._token:
                self._yielded += 1
                if self._yielded == len(indices):
                    self._finish_pass()
            yield index

    def _finish_pass(self) -> None:
        """The live iterator hands out its last index: one warning when this pass repeats the last one's epoch."""
        repeated = self._last_pass == self.epoch
        self._last_pass = self.epoch
        if not repeated or self._warned or not self.shuffle or self.rank != 0:
            return
        self._warned = True
        warnings.warn(
            f"DistributedSampler: a second full pass ran with epoch number {self.epoch} (set_epoch() was not "
            f"called, or called with the same number), so it repeated epoch {self.epoch}'s order, as torch's "
            "DistributedSampler does. Call sampler.set_epoch(epoch) before each epoch for a new shuffle each "
            "epoch; for evaluation, where the order does not matter, pass shuffle=False or use "
            "lockstep.data.EvalSampler (shown once, on rank 0)",
            UserWarning,
            stacklevel=3,  # _finish_pass <- _count <- whatever pulled the index (the loader, or the loop)
        )

    def _consumed(self) -> int:
        counted = self._advanced if self._explicit else self._yielded * self.num_replicas
        return min(self._start + counted, self._end)

    def _length(self, start: int) -> int:
        end = epoch_end(
            len(self.dataset), num_replicas=self.num_replicas, start=start, drop_last=self.drop_last
        )
        return (end - start) // self.num_replicas

    def _check_state(self, state: Any) -> tuple[int, int]:
        return check_saved_state(
            state, dataset_len=len(self.dataset), seed=self.seed, shuffle=self.shuffle, tag=self._tag()
        )

    def _tag(self) -> str:
        return rank_tag(self.rank, self.num_replicas) if self.num_replicas > 1 else ""
