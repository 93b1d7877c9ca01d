"""`replicate`: lockstep's native face, a module made a replica in place, and the `ReplicaHandle` it returns."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine.buckets.bucket_launch import CommHook
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.stats import EngineStats
from lockstep.engine.dropin.compile_support import SplitHooks
from lockstep.engine.dropin.joinable import JoinableReplica
from lockstep.engine.optim.overlapped_optimizer import OverlappedOptimizer
from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.engine.periodic.outer_sync import OuterSync
from lockstep.engine.periodic.periodic_mode import PeriodicMode
from lockstep.engine.replica.state import ReplicaState
from lockstep.errors import ConfigError, NotSupportedError
from lockstep.plan import Plan


class ReplicaHandle(JoinableReplica):
    """What `replicate` returns: control over a module replicated in place."""

    def __init__(self, replica: ReplicaState, hooks: list[Any]) -> None:
        self._replica, self._hooks = replica, hooks

    @property
    def _engine(self) -> ReplicaState:
        return self._replica

    @property
    def module(self) -> nn.Module:
        return self._replica.module

    @property
    def policy(self) -> SyncPolicy:
        return self._replica.policy

    @property
    def sync_policy(self) -> SyncPolicy | None:
        """The periodic sync's policy (None: the replicas average every step), as ShardHandle.sync_policy: the
        one name both handles answer to."""
        policy = self._replica.policy
        return policy if policy.periodic else None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside accumulate gradients locally; the next synced backward reduces the sum."""
        with self._replica.no_sync():
            yield

    def stats(self) -> EngineStats:
        """Bucket layout, last step's and mean timings (forward, backward, comm, overlap), bytes sent.

        Returns:
            An EngineStats (in deterministic mode: the exact buckets and the steps redone).
        """
        return self._replica.stats()

    def accumulate(
        self,
        fn: Callable[[Any], Any],
        micro_batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int = 0,
    ) -> dict[int, Any]:
        """One training step of K micro-batches over the ranks; afterwards `.grad` holds their mean.

        The step's global batch is `num_micro_batches` (K) micro-batches of a fixed size; `micro_batches`
        maps this rank's ordinals (`owned_micro_batches(K)`: rank r of W owns r, r + W, ...) to their
        batches. `fn(batch)` runs forward and backward of one micro-batch (`loss.backward()`, its loss the
        micro-batch's mean) and may return anything (the loss, say). `step` and `seed` seed each micro-
        batch's random numbers (dropout); BatchNorm uses each micro-batch's statistics and its running
        buffers are updated as if one process had run the micro-batches in order. Returns
        {ordinal: fn's result} for this rank's micro-batches.

        With SyncPolicy(deterministic=True) the mean is exact: bit for bit the same at every world size
        (`fn` may be called twice for a micro-batch in the rare step that is redone). Under the default
        policy the engine sums in float with its usual buckets, overlapped with the last backward: the
        same result up to rounding, at the default mode's speed; then every rank needs a micro-batch
        (K >= W).

        Args:
            fn: forward and backward of one micro-batch; its result is returned by ordinal.
            micro_batches: {ordinal: batch} for exactly this rank's ordinals of the step.
            num_micro_batches: K, the step's micro-batches over all ranks (not the world size).
            step: the step's index, which seeds its micro-batches' random numbers.
            seed: the run's seed, mixed into the same.

        Returns:
            {ordinal: fn(batch)} for this rank's micro-batches.

        Raises:
            ConfigError: K, step or the ordinals are wrong for this rank (every rank raises), or K < W
                under the default policy.
        """
        return self._replica.accumulate(
            fn, micro_batches, num_micro_batches=num_micro_batches, step=step, seed=seed
        )

    def owned_micro_batches(self, num_micro_batches: int) -> list[int]:
        """The ordinals of a step's K micro-batches that this rank computes in accumulate()."""
        return self._replica.owned_micro_batches(num_micro_batches)

    def after_optimizer_step(self) -> bool:
        """Low-communication training (SyncPolicy(sync=...)): call after each optimizer step. Counts the
        step and, every sync_every steps, syncs the replicas (all ranks must call it equally often).

        Returns:
            True when this call synced the replicas (or a fragment of them).

        Raises:
            NotSupportedError: the policy averages every step (sync="allreduce"): there is nothing to do.
        """
        return self._periodic("after_optimizer_step()").after_optimizer_step()

    def before_optimizer_step(self) -> bool:
        """Low-communication training: call before each optimizer step (after backward, before clipping).
        During the data-parallel warm-up (SyncPolicy.warmup_steps) it averages the gradients; True then."""
        return self._periodic("before_optimizer_step()").before_optimizer_step()

    def flush_sync(self) -> bool:
        """Low-communication training, at the end of training: apply the streaming fragments still in
        flight (they would otherwise be applied SyncPolicy.fragment_delay inner steps after their launch).
        True when there was one."""
        return self._periodic("flush_sync()").flush()

    def sync_state_dict(self, *, wait: bool = True) -> dict[str, Any]:
        """Low-communication training: the outer state a resume needs (steps counted, the anchor, the outer
        optimizer's momentum); the same on every rank. The rank's parameters and inner optimizer state are
        the caller's to save. wait=False (streaming): a fragment's mean still in flight is not waited for;
        the state holds this rank's contribution to each instead, sent again over the group of the replica
        it is loaded into (live mode's rollback: engine/periodic/outer_sync.py)."""
        return self._periodic("sync_state_dict()").state_dict(wait=wait)

    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what sync_state_dict() returned (on every rank)."""
        self._periodic("load_sync_state_dict()").load_state_dict(state)

    def _periodic(self, what: str) -> OuterSync:
        mode = self._replica.mode
        if not isinstance(mode, PeriodicMode):
            raise NotSupportedError(
                f"{what} belongs to low-communication training; this replica averages gradients every step "
                "(SyncPolicy(sync='allreduce')): replicate with SyncPolicy(sync='local_sgd' or 'diloco') to use it"
            )
        return mode.outer

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        self._replica.register_comm_hook(state, hook)

    def shard_optimizer(
        self, optimizer: torch.optim.Optimizer, *, piece_numel: int | None = None
    ) -> ShardedOptimizer:
        """Shard `optimizer`'s state over the replica's ranks (ZeRO-1): each rank steps its share.

        Step the returned object instead of `optimizer` (`sharded.step()`, `sharded.zero_grad()`); build LR
        schedulers on `optimizer` itself. Every rank must step it at every step (not inside join()).
        Parameters and optimizer state stay bitwise equal to an unsharded run for optimizers that update
        each parameter from its own gradient and state (SGD, Adam, AdamW); each rank holds the state of
        its share only, `sharded.state` (the optimizer's own `state` stays empty). For an elementwise
        optimizer (SGD, Adam, AdamW, ...: shard_units.ELEMENTWISE) large parameters are cut into pieces,
        so each rank holds about 1/world of the state even when one weight dominates the model. For a
        checkpoint, `consolidate_state_dict()` on every rank, then `state_dict()` is the full state
        (lockstep's CheckpointManager does both); `load_state_dict(full)` keeps this rank's share.

        Args:
            optimizer: a torch optimizer over the module's parameters, with no state yet or the same
                state on every rank.
            piece_numel: elements per piece of a cut parameter (default: about 1/32 of the model, at
                least 2**18); only for an elementwise optimizer.

        Returns:
            A ShardedOptimizer (see lockstep.engine.optim.shard_optimizer).

        Raises:
            ConfigError: not a torch optimizer, a parameter listed twice, or piece_numel with an
                optimizer that is not elementwise.
        """
        return ShardedOptimizer(optimizer, process_group=self._replica.group, piece_numel=piece_numel)

    def overlap_optimizer(
        self,
        optimizer: torch.optim.Optimizer | ShardedOptimizer,
        *,
        clip_grad_norm: bool = False,
        scaler: Any = None,
    ) -> OverlappedOptimizer:
        """Overlap `optimizer` with communication: each bucket's parameters step during backward.

        As soon as a bucket's averaged gradients are back, its parameters take their optimizer step while
        backward (and the other buckets' all-reduces) go on; `step()` on the returned optimizer then steps
        whatever is left. For SGD, Adam and AdamW (LR schedules included) the parameters and the
        optimizer state are bitwise those of the plain step. Where the step needs every gradient first,
        the returned optimizer takes the plain step and says why once (a UserWarning): gradient clipping
        by global norm (`clip_grad_norm=True`), an enabled fp16 GradScaler (`scaler=`), an optimizer
        lockstep does not know, deterministic mode, and steps through accumulate().

        Use the returned optimizer in the loop (`backward()`, `step()`, `zero_grad()`; a scheduler or
        GradScaler may take either); accumulate over several backwards inside `no_sync()` only.

        With sharded state, `overlap_optimizer(shard_optimizer(optimizer))`: each bucket's step takes the
        parameters this rank owns, and their owners' broadcasts start right after it (on a second process
        group of the same ranks, made here: call it on every rank); `step()` steps the rest of the share and
        waits for every broadcast. The bits are the unsharded step's; `state_dict()` and
        `consolidate_state_dict()` are the ShardedOptimizer's. A fallback takes the plain sharded step.

        Args:
            optimizer: the torch optimizer over this module's parameters, or the ShardedOptimizer that
                `shard_optimizer()` returned for it.
            clip_grad_norm: True if the loop clips gradients (or edits `.grad`) between backward() and step().
            scaler: the loop's torch.amp.GradScaler, if any (enabled: fp16, the plain step).

        Returns:
            An OverlappedOptimizer: the same param_groups, state and state_dict as `optimizer`.

        Raises:
            ConfigError: `optimizer` is neither a torch.optim.Optimizer nor this replica's ShardedOptimizer.
            UsageError: an optimizer is already overlapped on this replica. Later, from step() or backward:
                a gradient changed after its parameter stepped (undeclared clipping), a second synced
                backward before step(), or `optimizer.step()` called instead of the returned one's.
        """
        return self._replica.overlap_optimizer(optimizer, clip_grad_norm=clip_grad_norm, scaler=scaler)

    def remove(self) -> None:
        """Undo replicate: the module trains locally again (no hooks, no communication)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._replica.remove()


def replicate(
    module: nn.Module, *, policy: SyncPolicy | None = None, process_group: dist.ProcessGroup | None = None
) -> ReplicaHandle:
    """Make `module` a data-parallel replica in place: same object, same state_dict keys.

    Parameters and buffers are checked and broadcast from rank 0 now; from then on every forward
    with grad enabled is followed by a backward that averages gradients across ranks.

    Args:
        module: the model, with the same structure on every rank (names, shapes, dtypes).
        policy: the engine's settings (`SyncPolicy()` when None): bucket sizes, unused parameters, static
            graph, reduce dtype, deterministic mode.
        process_group: the group to replicate over (the default group when None).

    Returns:
        A ReplicaHandle: `no_sync()`, `join()`, `accumulate()`, `owned_micro_batches()`,
        `register_comm_hook()`, `shard_optimizer()`, `stats()`, and `remove()` to make the module plain
        again.

    Raises:
        NoProcessGroupError: no process group exists yet (call lockstep.init() first).
        NoTrainableParametersError: the module has no parameter that requires grad.
        CollectiveMismatchError: the ranks built different models (the message names the rank and the
            parameter that differ).
        NotSupportedError: deterministic mode with sparse gradients.
        ConfigError: the module is already replicated.
    """
    if any(
        isinstance(getattr(h, "__self__", None), _ForwardHooks) for h in module._forward_pre_hooks.values()
    ):
        raise ConfigError(
            f"module {type(module).__name__} is already replicated; call remove() on its handle "
            "before replicating it again"
        )
    replica = ReplicaState(module, policy or SyncPolicy(), process_group)
    hooks = _ForwardHooks(replica)
    forward_hooks = [
        module.register_forward_pre_hook(hooks.before),
        module.register_forward_hook(hooks.after),
    ]
    # torch.compile: the module's compiled graphs split at bucket boundaries (compile_support.py), where
    # backward communicates (low-communication modes never do: a split would only cost the compiler)
    if not replica.policy.periodic:
        forward_hooks += SplitHooks(replica.policy).register(module)
    return ReplicaHandle(replica, forward_hooks)


def overlap_optimizer(
    model: JoinableReplica,
    optimizer: torch.optim.Optimizer | ShardedOptimizer,
    *,
    clip_grad_norm: bool,
    scaler: Any,
    plan: Plan | None = None,
) -> OverlappedOptimizer:
    """`ReplicaHandle.overlap_optimizer` for either face: fit's use of the drop-in class, whose own
    methods keep torch's semantics (torch's DDP has no overlapped optimizer under its names). `plan`: the
    run's, built at the door (fit's; lockstep/plan.py), which says whether the overlap falls back."""
    return model._engine.overlap_optimizer(optimizer, clip_grad_norm=clip_grad_norm, scaler=scaler, plan=plan)


class _ForwardHooks:
    """replicate's forward hooks on the user's module (their owner marks the module as replicated)."""

    def __init__(self, replica: ReplicaState) -> None:
        self.replica = replica

    def before(self, _module: nn.Module, _args: Any) -> None:
        self.replica.pre_forward()

    def after(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        return self.replica.post_forward(output)
