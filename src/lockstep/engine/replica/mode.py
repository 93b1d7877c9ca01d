"""The engine's modes: one object per replica, chosen once from the policy, behind one small interface.

A replica (state.py) does the same things in every mode: it starts a forward, ends one, runs
accumulate()'s micro-batched steps, reports statistics and detaches. What depends on the mode is behind
`EngineMode`, as Lightning Fabric's `_DDPBackwardSyncControl` keeps one small object per strategy:

- `BucketedMode` (the default, and the drop-in class): the bucketed Reducer (reducer.py), which reduces
  during every synced backward. Its forwards drain the fast hooks, rebuild the buckets once, broadcast
  buffers and arm the reducer; join() steps through join.py. accumulate() is the micro-step driver
  (micro_step.py) with the float reduction.
- `PeriodicMode` (SyncPolicy(sync=...) other than "allreduce"; periodic_mode.py): no reduction in
  backward, the replicas meet every sync_every optimizer steps (outer_sync.py).
- `ExactMode` (SyncPolicy(deterministic=True)): the ExactReducer (exact.py) with a hook per parameter;
  a training forward must run inside accumulate(), whose driver uses the exact reduction.

Features of the bucketed reducer alone (communication hooks, join(), static graphs, the bucket layout)
reach it through `mode.reducer`; the exact mode raises the NotSupportedError that says why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from lockstep.engine.buckets.bucket_tuner import BucketTuner
from lockstep.engine.buckets.join import JoinReplica, join_pre_forward
from lockstep.engine.buckets.reducer import Reducer
from lockstep.engine.buckets.step import NoStepper
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.stats import EngineStats
from lockstep.engine.deterministic.exact import ExactReducer
from lockstep.engine.deterministic.micro_step import ExactReduction, FloatHost, FloatReduction, MicroSteps
from lockstep.engine.optim.optimizer_steps import ACCUMULATE_REASON, DETERMINISTIC_REASON, OverlappedSteps
from lockstep.engine.optim.overlapped_optimizer import OverlappedOptimizer
from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.engine.optim.shard_overlap import BucketBroadcasts, side_group
from lockstep.engine.periodic.periodic_mode import PeriodicMode
from lockstep.errors import NotSupportedError, UsageError
from lockstep.plan import Reduction


class Replica(JoinReplica, FloatHost, Protocol):
    """What a mode needs of its replica (state.ReplicaState): join()'s and the float reduction's needs, and these."""

    @property
    def policy(self) -> SyncPolicy: ...

    @property
    def comm_device(self) -> torch.device: ...

    @property
    def flags(self) -> Any:
        """torch's switches: require_backward_grad_sync, require_forward_param_sync, broadcast_buffers."""
        ...

    @property
    def t_forward(self) -> float:
        """When the forward under way began."""
        ...

    def broadcast_buffers(self) -> None:
        """torch's forward buffer sync: every rank takes the source rank's buffers."""
        ...


class EngineMode(Protocol):
    """What a replica needs of its mode (see the module docstring)."""

    @property
    def reducer(self) -> Reducer:
        """The bucketed reducer (NotSupportedError in a mode without one)."""
        ...

    def pre_forward(self, replica: Replica) -> None:
        """Before the user's forward (the replica has started its clock and the step's progress)."""
        ...

    def post_forward(self, replica: Replica, output: Any) -> None:
        """After the user's forward, which returned `output`."""
        ...

    def micro_steps(self, replica: Replica) -> MicroSteps:
        """accumulate()'s driver for this replica."""
        ...

    def accumulate(
        self,
        replica: Replica,
        fn: Callable[[Any], Any],
        micro_batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int,
    ) -> dict[int, Any]:
        """One step of K micro-batches (micro_step.py) with this mode's reduction."""
        ...

    def stats(self, world: int) -> EngineStats:
        """handle.stats(): the layout and the timings, as this mode knows them."""
        ...

    def overlap_optimizer(
        self, replica: Replica, optimizer: torch.optim.Optimizer | ShardedOptimizer, fallback: str | None
    ) -> OverlappedOptimizer:
        """`optimizer` stepped by the engine bucket by bucket (`fallback`: why it cannot be, or None)."""
        ...

    def remove(self) -> None:
        """Detach every hook: the module trains locally again."""
        ...


def choose_mode(
    replica: Replica, params: Sequence[nn.Parameter], names: Sequence[str], sparse: Sequence[bool]
) -> EngineMode:
    """The mode the replica's policy asks for, over its trainable `params` (`sparse`: which get sparse grads)."""
    reduction = replica.policy.plan.reduction
    if reduction is Reduction.PERIODIC:
        return PeriodicMode(
            replica.module, replica.policy, replica.group, world=replica.world, tag=replica.tag
        )
    if reduction is Reduction.EXACT:
        if any(sparse):
            raise NotSupportedError(
                f"{replica.tag}SyncPolicy(deterministic=True) sums dense gradients exactly; "
                f"{names[sparse.index(True)]!r} gets sparse ones (nn.Embedding(sparse=True)): make it dense"
            )
        exact = ExactReducer(
            params,
            names,
            replica.group,
            rank=replica.rank,
            world_size=replica.world,
            device=replica.comm_device,
        )
        return ExactMode(replica, exact)
    reducer = Reducer(
        params,
        names,
        replica.policy.bucket_settings,  # what the bucketed reducer reads of the policy
        replica.group,
        rank=replica.rank,
        world_size=replica.world,
        sparse=sparse,
        device=replica.comm_device,
        stepper=NoStepper(),  # the user steps after backward; overlap_optimizer hands another (step_with)
    )
    reducer.attach_hooks()
    return BucketedMode(reducer, BucketTuner(reducer) if replica.policy.tune_buckets else None)


class BucketedMode:
    """The default mode: the bucketed Reducer reduces during every synced backward."""

    def __init__(self, reducer: Reducer, tuner: BucketTuner | None = None) -> None:
        self.reducer, self.tuner = reducer, tuner  # tuner: SyncPolicy(bucket_cap_mb="auto")
        self._micro_steps: MicroSteps | None = None  # made at accumulate()'s first use
        self._overlapped = False  # an optimizer is stepped by the reducer (overlap_optimizer)

    def pre_forward(self, replica: Replica) -> None:
        syncing = torch.is_grad_enabled() and replica.flags.require_backward_grad_sync
        self.reducer.drain()  # a local backward's (no_sync) fast-hook reports: before anything else
        if replica.join_config.enable:
            join_pre_forward(replica, syncing)
            return
        if syncing:
            self.reducer.maybe_rebuild()
            if self.tuner is not None:
                self.tuner.pre_forward()
        if replica.will_broadcast_buffers():
            replica.broadcast_buffers()

    def post_forward(self, replica: Replica, output: Any) -> None:
        syncing = torch.is_grad_enabled() and replica.flags.require_backward_grad_sync
        replica.flags.require_forward_param_sync = syncing
        if syncing:
            self.reducer.prepare_for_backward(list(_find_tensors(output)), replica.t_forward)

    def micro_steps(self, replica: Replica) -> MicroSteps:
        if self._micro_steps is None:
            self._micro_steps = MicroSteps(
                replica.module, replica.group, rank=replica.rank, world=replica.world
            )
        return self._micro_steps

    def accumulate(
        self,
        replica: Replica,
        fn: Callable[[Any], Any],
        micro_batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int,
    ) -> dict[int, Any]:
        with self.reducer.stepper.suspended(ACCUMULATE_REASON):
            return self.micro_steps(replica).run(
                FloatReduction(replica),
                fn,
                micro_batches,
                num_micro_batches=num_micro_batches,
                step=step,
                seed=seed,
            )

    def overlap_optimizer(
        self, replica: Replica, optimizer: torch.optim.Optimizer | ShardedOptimizer, fallback: str | None
    ) -> OverlappedOptimizer:
        if self._overlapped:
            raise UsageError(
                f"{replica.tag}overlap_optimizer was already called on this replica: the engine steps one "
                "optimizer; give it one optimizer over all the parameters (param_groups for different settings)"
            )
        broadcasts = None  # the owners' broadcasts, bucket by bucket: sharded, overlapped, world > 1
        if fallback is None and isinstance(optimizer, ShardedOptimizer) and optimizer.world > 1:
            broadcasts = BucketBroadcasts(optimizer, side_group(optimizer.group))
        overlapped = OverlappedOptimizer(optimizer, fallback=fallback, tag=replica.tag, broadcasts=broadcasts)
        if fallback is None:
            self.reducer.step_with(OverlappedSteps(overlapped))
            self._overlapped = True
        return overlapped

    def stats(self, world: int) -> EngineStats:
        r = self.reducer
        return EngineStats(
            world_size=world,
            num_parameters=len(r.params),
            num_buckets=len(r.buckets),
            bucket_sizes_bytes=[b.nbytes for b in r.buckets],
            bucket_num_params=[len(b.params) for b in r.buckets],
            buckets_rebuilt=r.rebuilt,
            synced_steps=r.stats.steps,
            last=r.stats.last,
            mean=r.stats.mean(),
            extras={
                "bucket_dtypes": [str(b.dtype).replace("torch.", "") for b in r.buckets],
                **r.stepper.stats(),
                "bytes_communicated_total": r.stats.total_bytes,
                **(self.tuner.stats() if self.tuner is not None else {}),
            },
        )

    def remove(self) -> None:
        self.reducer.detach_hooks()
        if self._micro_steps is not None:
            self._micro_steps.remove()


class ExactMode:
    """Deterministic mode: exact sums of micro-batches (exact.py), inside accumulate() only."""

    def __init__(self, replica: Replica, exact: ExactReducer) -> None:
        self.exact, self._tag = exact, replica.tag
        self._micro_steps = MicroSteps(replica.module, replica.group, rank=exact.rank, world=exact.world)
        self._reduction = ExactReduction(exact)
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(exact.post_accumulate_grad, i))
            for i, p in enumerate(exact.params)
        ]

    @property
    def reducer(self) -> Reducer:
        raise NotSupportedError(
            f"{self._tag}this replica runs SyncPolicy(deterministic=True): buckets, communication hooks and "
            "join() do not apply to its exact reduction; replicate with SyncPolicy() to use them"
        )

    def pre_forward(self, replica: Replica) -> None:
        module = replica.module
        if torch.is_grad_enabled() and module.training and not self.exact.active:
            raise UsageError(
                f"{self._tag}{type(module).__name__} is replicated with SyncPolicy(deterministic=True), so a "
                "training forward must run inside handle.accumulate(fn, micro_batches, num_micro_batches=K, "
                "step=i); outside it nothing would average the gradients and the replicas would drift apart. "
                "Evaluate under torch.no_grad() or model.eval()"
            )

    def post_forward(self, replica: Replica, output: Any) -> None:
        pass  # the exact reducer's hooks act inside accumulate() only

    def micro_steps(self, replica: Replica) -> MicroSteps:
        return self._micro_steps

    def accumulate(
        self,
        replica: Replica,
        fn: Callable[[Any], Any],
        micro_batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int,
    ) -> dict[int, Any]:
        return self._micro_steps.run(
            self._reduction, fn, micro_batches, num_micro_batches=num_micro_batches, step=step, seed=seed
        )

    def overlap_optimizer(
        self, replica: Replica, optimizer: torch.optim.Optimizer | ShardedOptimizer, fallback: str | None
    ) -> OverlappedOptimizer:
        return OverlappedOptimizer(optimizer, fallback=DETERMINISTIC_REASON, tag=replica.tag)

    def stats(self, world: int) -> EngineStats:
        exact, steps = self.exact, self._micro_steps
        return EngineStats(
            world_size=world,
            num_parameters=len(exact.params),
            num_buckets=len(exact.buckets),
            bucket_sizes_bytes=[8 * b.numel for b in exact.buckets],
            bucket_num_params=[len(b.indices) for b in exact.buckets],
            buckets_rebuilt=False,
            synced_steps=steps.steps,
            last=None,
            mean=None,
            extras={
                "deterministic": True,
                "redone_steps": steps.redos,
                "buckets_launched_in_backward": exact.launched_in_backward,
                "bytes_communicated_total": exact.bytes_sent,
            },
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._micro_steps.remove()


def _find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a forward's output (tensors, lists, tuples, dicts, dataclass-like objects)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _find_tensors(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _find_tensors(getattr(obj, name))
