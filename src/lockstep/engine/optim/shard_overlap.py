"""What an overlapped optimizer steps: whole parameters, or a share whose owners send each bucket in backward.

The broadcasts of a bucket's parameters start during backward, as soon as the owners stepped that bucket.

With `handle.overlap_optimizer(handle.shard_optimizer(optimizer))` the engine (optimizer_steps.py) steps,
as each bucket's averaged gradients come back, the parameters of that bucket this rank owns
(overlapped_optimizer.py restricts the step to them); `BucketBroadcasts.stepped(b)` then starts the
broadcast of every parameter of the bucket from its owner, and `finish()` (in the optimizer's step())
starts whatever is left and waits for all of it, so the next forward sees every updated parameter.

Why a second process group: the broadcasts start when a bucket's all-reduce is seen complete, which is a
rank's own observation (`Future.done()`), while the engine keeps launching the later buckets' all-reduces
on the replica's group. On one group the ranks would issue the two kinds of collective in different
orders, and gloo (and NCCL) pair collectives by the order they are issued. On their own group, the
broadcasts only need the same order among themselves on every rank: each bucket's broadcast starts only
once every earlier bucket's has (a prefix, in bucket order), the stepped buckets still waiting at the
end of backward then in bucket order (`flush`), and in `finish()` the buckets never stepped in the
engine and the parameters outside every bucket, in a fixed order. Every rank thus issues the same
sequence, whatever it observed when.

The bits are the sharded step's: each parameter is stepped by its owner from the same averaged gradient
and state, and every rank takes its value from the owner, in place; the waits all come before step()
returns.

The OverlappedOptimizer (overlapped_optimizer.py) holds one of two behaviours behind `StepParams`,
chosen once at its construction: `WholeParams` for a plain torch optimizer (any parameter, restricted by
swapping the param lists for one step; nothing to send after), `ShardedParams` for a ShardedOptimizer
(this rank's share; its broadcasts are a BucketBroadcasts at world > 1 when the engine steps, or
`NoBroadcasts`: a world of one, or the plain fallback step, where the ShardedOptimizer gathers itself).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lockstep.engine.buckets.bucket_memory import Bucket
from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.engine.optim.shard_units import ParamGather, swapped_params
from lockstep.errors import InternalError


def side_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new group of the same ranks and backend as `group` (a collective of its members only)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    backend = dist.get_backend(group)
    made = dist.new_group(ranks=ranks, backend=backend, use_local_synchronization=True)
    if made is None or made == dist.GroupMember.NON_GROUP_MEMBER:  # this rank is one of `ranks`: never
        raise InternalError(f"lockstep bug: the broadcast group of ranks {ranks} left this rank out")
    return made


class BucketBroadcasts:
    """The owners' broadcasts of a sharded optimizer's parameters, bucket by bucket (see the module doc)."""

    def __init__(self, shard: ShardedOptimizer, group: dist.ProcessGroup) -> None:
        self.shard, self.group = shard, group
        self.active = False  # this backward's step is overlapped: step() must finish it
        self.launched_in_backward = 0  # buckets whose broadcast started before the end of backward, so far
        self._index = {id(p): i for i, p in enumerate(shard.params)}  # position in the optimizer's list
        # Weak references to the reducer's buckets: a rebuild frees the old ones' memory at once.
        self._gathers: dict[int, tuple[weakref.ref[Bucket], ParamGather]] = {}  # index -> (bucket, messages)
        self._buckets: list[weakref.ref[Bucket]] = []  # the reducer's buckets at the last end of backward
        self._rest: ParamGather | None = None  # the optimizer's parameters in no bucket (None: none)
        self._stepped: dict[int, Bucket] = {}  # this backward's stepped buckets, by index
        self._launched: set[int] = set()  # bucket indices whose broadcast started in this step
        self._next = 0  # the lowest bucket index not launched yet (the prefix)
        self._pending: list[tuple[ParamGather, list[tuple[Any, Any]]]] = []

    def begin(self) -> None:
        """A synced backward starts and the engine steps its buckets."""
        self.active = True
        self._stepped, self._launched, self._next, self._pending = {}, set(), 0, []

    def stepped(self, b: Bucket, *, in_backward: bool) -> None:
        """Bucket b's owned parameters stepped: start its broadcast, and any later one the prefix allows."""
        self._stepped[b.index] = b
        while self._next in self._stepped:
            self._launch(self._stepped[self._next])
            self.launched_in_backward += int(in_backward)
            self._next += 1

    def flush(self, buckets: Sequence[Bucket]) -> None:
        """End of backward (every rank stepped the same buckets): start every stepped bucket's broadcast."""
        self._see(buckets)
        for b in buckets:
            if b.index in self._stepped and b.index not in self._launched:
                self._launch(b)

    def finish(self, buckets: Sequence[Bucket] | None = None) -> None:
        """In step(), after every owned parameter stepped (or after a failed backward, to keep the group's
        sequence the same on every rank): start every broadcast not started yet, then wait for all."""
        if buckets is not None:
            self._see(buckets)
        for b in self._alive():
            if b.index not in self._launched:
                self._launch(b)
        if self._rest is not None:
            self._pending.append((self._rest, self._rest.launch(self.group, self.shard.global_rank)))
        pending, self._pending, self.active = self._pending, [], False
        self._stepped = {}  # no bucket kept alive past the step: a rebuild frees the old ones at once
        with torch.no_grad():
            for gather, launched in pending:
                gather.wait(launched)
        self.shard.stepped_elsewhere()

    def abandon(self, buckets: Sequence[Bucket] | None = None) -> bool:
        """A backward or a step() failed: the broadcasts in flight end on every rank alike. True: some rank
        may have stepped some parameters, so the step is broken even where this rank stepped none."""
        if self.active:
            self.finish(buckets)
        return True

    def stats(self) -> dict[str, Any]:
        return {"optimizer_broadcasts_launched_in_backward": self.launched_in_backward}

    # ---------------------------------------------------------------- inside

    def _launch(self, b: Bucket) -> None:
        self._launched.add(b.index)
        gather = self._gather(b)
        if gather.messages:
            with torch.no_grad():
                self._pending.append((gather, gather.launch(self.group, self.shard.global_rank)))

    def _gather(self, b: Bucket) -> ParamGather:
        cached = self._gathers.get(b.index)
        if cached is not None and cached[0]() is b:
            return cached[1]
        units = [u for p in b.params if id(p) in self._index for u in self._units_of(p)]
        gather = self._units_gather(units)
        self._gathers[b.index] = (weakref.ref(b), gather)
        return gather

    def _alive(self) -> list[Bucket]:
        """The buckets of the last `_see` (all alive: the reducer rebuilds only before a forward)."""
        return [b for ref in self._buckets if (b := ref()) is not None]

    def _see(self, buckets: Sequence[Bucket]) -> None:
        """Take the reducer's buckets (rebuilt after the first steps): the messages are laid out again."""
        if len(buckets) == len(self._buckets) and all(a() is b for a, b in zip(self._buckets, buckets)):
            return
        self._buckets = [weakref.ref(b) for b in buckets]
        self._gathers = {i: g for i, g in self._gathers.items() if any(g[0]() is b for b in buckets)}
        inside = {id(p) for b in buckets for p in b.params}
        rest = [u for p in self.shard.params if id(p) not in inside for u in self._units_of(p)]
        self._rest = self._units_gather(rest) if rest else None

    def _units_of(self, p: torch.Tensor) -> list[int]:
        return self.shard.units.of_param[self._index[id(p)]]

    def _units_gather(self, units: list[int]) -> ParamGather:
        """The messages that send `units` (the shard's) from their owners."""
        tensors, owners = self.shard.units.tensors, self.shard.owners
        return ParamGather([tensors[u] for u in units], [owners[u] for u in units], self.shard.rank)


class StepParams(Protocol):
    """What an OverlappedOptimizer steps, and what follows (WholeParams, ShardedParams: below)."""

    consolidate_state_dict: Callable[..., None] | None  # None: the state is whole on every rank

    @property
    def state(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def mine(self) -> set[int]:
        """`id()` of the parameters this rank steps."""
        ...

    def step_some(self, chosen: list[list[torch.Tensor]]) -> None:
        """One step of the wrapped optimizer over `chosen` (per param group) only."""
        ...

    def step_all(self, closure: Callable[[], float] | None) -> float | None:
        """The plain step (the fallback, or no parameter stepped in the engine)."""
        ...

    def order_new_state(self, state_len: int, param_groups: list[dict[str, Any]]) -> None:
        """After step(): the state entries made in it, in the order the whole step would have made them."""
        ...

    def in_flight(self) -> bool:
        """Broadcasts of this step are in flight (step() must finish them)."""
        ...

    def begin(self) -> None:
        """A synced backward starts and the engine steps its buckets (optimizer_steps.py)."""
        ...

    def stepped(self, b: Bucket, *, in_backward: bool) -> None:
        """Bucket b's parameters stepped in the engine."""
        ...

    def flush(self, buckets: Sequence[Bucket]) -> None:
        """End of a good backward."""
        ...

    def abandon(self, buckets: Sequence[Bucket] | None = None) -> bool:
        """A backward or step() failed: end what is in flight alike on every rank; True: the step is
        broken even where this rank stepped nothing."""
        ...

    def finish(self) -> None:
        """End of step(): every parameter has its updated value on this rank."""
        ...

    def stats(self) -> dict[str, Any]:
        """For EngineStats.extras."""
        ...


class WholeParams:
    """What an OverlappedOptimizer of a plain torch optimizer steps: any of its parameters, restricted by
    swapping the groups' param lists for one step (shard_units.swapped_params); nothing to send after."""

    consolidate_state_dict: Callable[..., None] | None = None  # the state is whole on every rank

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def mine(self) -> set[int]:
        return {id(p) for group in self.optimizer.param_groups for p in group["params"]}

    def step_some(self, chosen: list[list[torch.Tensor]]) -> None:
        with swapped_params(self.optimizer, chosen, self.optimizer.state):
            self.optimizer.step()

    def step_all(self, closure: Callable[[], float] | None) -> float | None:
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def order_new_state(self, state_len: int, param_groups: list[dict[str, Any]]) -> None:
        """state_dict() then lists the entries made in this step as the plain step does: the groups' order,
        after the older ones."""
        state = self.optimizer.state
        if len(state) == state_len:
            return
        keys = list(state)
        made = {id(p) for p in keys[state_len:]}
        ordered = keys[:state_len] + [p for group in param_groups for p in group["params"] if id(p) in made]
        if len(ordered) != len(keys) or all(a is b for a, b in zip(ordered, keys)):
            return
        entries = [(p, state[p]) for p in ordered]
        state.clear()  # in place: the wrapped optimizer's own dict
        state.update(entries)

    def in_flight(self) -> bool:
        return False

    def begin(self) -> None:
        pass

    def stepped(self, b: Bucket, *, in_backward: bool) -> None:
        pass

    def flush(self, buckets: Sequence[Bucket]) -> None:
        pass

    def abandon(self, buckets: Sequence[Bucket] | None = None) -> bool:
        return False

    def finish(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


class Broadcasts(Protocol):
    """How a sharded overlapped step's updated parameters reach every rank (BucketBroadcasts, NoBroadcasts)."""

    active: bool

    def begin(self) -> None: ...

    def stepped(self, b: Bucket, *, in_backward: bool) -> None: ...

    def flush(self, buckets: Sequence[Bucket]) -> None: ...

    def finish(self, buckets: Sequence[Bucket] | None = None) -> None: ...

    def abandon(self, buckets: Sequence[Bucket] | None = None) -> bool: ...

    def stats(self) -> dict[str, Any]: ...


class NoBroadcasts:
    """Nothing to send: a world of one (the share is everything), or no overlapped step (the fallback steps
    the ShardedOptimizer whole, which gathers the parameters itself)."""

    active = False

    def __init__(self, shard: ShardedOptimizer) -> None:
        self.shard = shard

    def begin(self) -> None:
        pass

    def stepped(self, b: Bucket, *, in_backward: bool) -> None:
        pass

    def flush(self, buckets: Sequence[Bucket]) -> None:
        pass

    def finish(self, buckets: Sequence[Bucket] | None = None) -> None:
        self.shard.stepped_elsewhere()  # the share is everything: a consolidated state is stale

    def abandon(self, buckets: Sequence[Bucket] | None = None) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {}


class ShardedParams:
    """What an OverlappedOptimizer of a ShardedOptimizer steps: this rank's share (a StepParams);
    `broadcasts` bring every parameter from its owner after."""

    def __init__(self, shard: ShardedOptimizer, broadcasts: Broadcasts | None) -> None:
        self.shard = shard
        self.broadcasts: Broadcasts = broadcasts or NoBroadcasts(shard)
        self.consolidate_state_dict: Callable[..., None] | None = shard.consolidate_state_dict

    @property
    def state(self) -> Any:
        """This rank's share of the state, keyed by its units."""
        return self.shard.state

    def state_dict(self) -> dict[str, Any]:
        return self.shard.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.shard.load_state_dict(state_dict)

    def mine(self) -> set[int]:
        return self.shard.kept_ids()

    def step_some(self, chosen: list[list[torch.Tensor]]) -> None:
        """This rank's units of those parameters, with its share of the state."""
        self.shard.step_share(chosen)

    def step_all(self, closure: Callable[[], float] | None) -> float | None:
        """This rank's share, then every parameter from its owner."""
        self.shard.step(closure)
        return None

    def order_new_state(self, state_len: int, param_groups: list[dict[str, Any]]) -> None:
        pass  # consolidated in parameter order

    def in_flight(self) -> bool:
        return self.broadcasts.active

    def begin(self) -> None:
        self.broadcasts.begin()

    def stepped(self, b: Bucket, *, in_backward: bool) -> None:
        self.broadcasts.stepped(b, in_backward=in_backward)

    def flush(self, buckets: Sequence[Bucket]) -> None:
        self.broadcasts.flush(buckets)

    def abandon(self, buckets: Sequence[Bucket] | None = None) -> bool:
        return self.broadcasts.abandon(buckets)

    def finish(self) -> None:
        self.broadcasts.finish()

    def stats(self) -> dict[str, Any]:
        return self.broadcasts.stats()
