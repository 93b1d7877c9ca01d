"""Per-model engine state: wrap-time sync, the engine's mode, the buffer sync, torch's switches and join()."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine.buckets.bucket_launch import CommHook
from lockstep.engine.buckets.join import EngineJoinHook, JoinSession
from lockstep.engine.buckets.reducer import Reducer
from lockstep.engine.core.init_sync import (
    RepeatedBroadcast,
    broadcast_coalesced,
    check_same_model,
    layout_key,
)
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.stats import EngineStats
from lockstep.engine.optim.optimizer_steps import fallback_reason, overlap_plan
from lockstep.engine.optim.overlapped_optimizer import OverlappedOptimizer
from lockstep.engine.optim.shard_optimizer import ShardedOptimizer
from lockstep.engine.replica.mode import EngineMode, choose_mode
from lockstep.errors import ConfigError, NoProcessGroupError, NoTrainableParametersError, rank_tag
from lockstep.plan import Plan
from lockstep.runtime import watchdog
from lockstep.runtime.collectives import comm_device
from lockstep.runtime.progress import PROGRESS
from lockstep.torch_private import JoinConfig, preserve_version_counter


class SyncFlags:
    """The two switches torch's DDP keeps as attributes, for `replicate` (the DDP wrapper is its own flags).

    require_backward_grad_sync: False makes the next forward's backward keep its gradients local (what
    no_sync() sets). require_forward_param_sync: buffers are broadcast before the next forward (set by
    the engine after each forward: True after a synced one). broadcast_buffers: the policy's switch.
    """

    def __init__(self, broadcast_buffers: bool) -> None:
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.broadcast_buffers = broadcast_buffers


class ReplicaState:
    """Everything the engine keeps for one replicated module; driven by the faces' forward wrappers
    (ddp.py, replicate.py). What depends on the policy's mode is one object, `mode` (mode.py).

    Nothing is stored on the user's module: it pickles, deep-copies and re-wraps like a plain module.
    """

    def __init__(
        self,
        module: nn.Module,
        policy: SyncPolicy,
        group: dist.ProcessGroup | None,
        *,
        flags: Any = None,
        init_sync: bool = True,
        init_sync_buffers: bool = True,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise NoProcessGroupError(
                f"no process group: {type(module).__name__} was wrapped before torch.distributed was "
                "initialized; call lockstep.init() (or torch.distributed.init_process_group) first"
            )
        watchdog.start(
            watchdog.hang_timeout_setting()
        )  # a program that called init_process_group itself gets one too
        self.module, self.policy, self.group = module, policy, group
        self.flags = flags if flags is not None else SyncFlags(policy.broadcast_buffers)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.tag = rank_tag(self.rank, self.world)
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))  # torch's ignore list
        named = [(n, p) for n, p in _unique_named(module.named_parameters()) if n not in ignored]
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise NoTrainableParametersError(
                f"{self.tag}{type(module).__name__} has no parameter that requires grad, so there is nothing "
                "to average across ranks (torch's DDP refuses it too); wrap a module with trainable parameters"
            )
        self._ignored_buffers = ignored
        self._all_params: list[torch.Tensor] = [
            p for _, p in named
        ]  # frozen ones too, for join()'s final sync
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        if self.world > 1 and init_sync:
            check_same_model(named, group, self.rank, self.world)
            broadcast_coalesced(
                [p for _, p in named] + (self.buffers if init_sync_buffers else []), self._src, group
            )
        self.comm_device = comm_device(group)
        params = [p for _, p in trainable]
        names = [n for n, _ in trainable]
        sparse = _sparse_flags(module, list(params))
        self.t_forward = 0.0  # when the forward under way began
        self.mode: EngineMode = choose_mode(self, params, names, sparse)  # once: it never changes
        # join(): torch's Join sets the config (read by its notify_join_context); join.py does the rest.
        self._join_config = JoinConfig.construct_disabled_join_config()
        self.join_session: JoinSession | None = None
        # The buffer sync's message layout, made at the first forward that syncs buffers; and torch's
        # modules_buffers: the buffers of the last sync (or of construction), whose number decides whether
        # a forward syncs. They are looked up again only then: a module without buffers never looks.
        self._buffer_broadcast: RepeatedBroadcast | None = None
        self._synced_buffers = self.buffers

    @property
    def reducer(self) -> Reducer:
        """The bucketed reducer (every mode but deterministic, which sums exactly without buckets)."""
        return self.mode.reducer

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The module's buffers now (looked up each time: a program may reassign one, like torch allows)."""
        return [b for n, b in _unique_named(self.module.named_buffers()) if n not in self._ignored_buffers]

    # pre_forward: the engine's work before the user's forward (the rest is the mode's)
    def pre_forward(self) -> None:
        self.t_forward = time.perf_counter()
        if torch.is_grad_enabled():
            PROGRESS.begin_step()
        self.mode.pre_forward(self)

    def broadcast_buffers(self) -> None:
        """Every rank takes the source rank's buffers (torch's forward buffer sync), with a message layout
        kept from one forward to the next while the buffers stay the same tensors."""
        buffers = self._synced_buffers = self.buffers
        plan = self._buffer_broadcast
        if plan is None or plan.key != layout_key(buffers):
            plan = self._buffer_broadcast = RepeatedBroadcast(buffers, self._src, self.group)
        with torch.no_grad():
            plan()

    def broadcast_buffers_for_step(self) -> None:
        """accumulate()'s step: the buffers broadcast now, once, and not by its forwards.

        Ranks that own different numbers of micro-batches run different forwards (no_sync ones first);
        left to pre_forward, the broadcast would come before the bucket rebuild on some ranks and after
        it on others, a collective mismatch.
        """
        if self.will_broadcast_buffers():
            self.broadcast_buffers()
        self.flags.require_forward_param_sync = False

    def will_broadcast_buffers(self) -> bool:
        """pre_forward broadcasts buffers (torch's will_sync_module_buffers, in a world above 1)."""
        flags = self.flags
        return bool(
            flags.require_forward_param_sync
            and flags.broadcast_buffers
            and self.world > 1
            and self._synced_buffers
        )

    def post_forward(self, output: Any) -> Any:
        self.mode.post_forward(self, output)
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside accumulate gradients locally; the next synced backward reduces the sum."""
        before = self.flags.require_backward_grad_sync
        self.flags.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.flags.require_backward_grad_sync = before

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        self.reducer.register_comm_hook(state, hook)

    def overlap_optimizer(
        self,
        optimizer: torch.optim.Optimizer | ShardedOptimizer,
        *,
        clip_grad_norm: bool,
        scaler: Any,
        plan: Plan | None = None,
    ) -> OverlappedOptimizer:
        """`optimizer`, stepped by the engine bucket by bucket where it can be (ReplicaHandle.overlap_optimizer).

        Whether it can be is the run's plan's (lockstep/plan.py): `plan`, the one the door built (fit's), or
        else this replica's policy's plan with what this call says (the overlap, clipping, the scaler, a
        sharded optimizer, live mode's sharding)."""
        live = False
        if isinstance(optimizer, ShardedOptimizer):
            live = self._check_shard(optimizer)
            inner = optimizer.optimizer
        elif isinstance(optimizer, torch.optim.Optimizer) and not isinstance(optimizer, OverlappedOptimizer):
            inner = optimizer
        else:
            raise ConfigError(
                f"{self.tag}overlap_optimizer expects the torch.optim.Optimizer over this model's parameters "
                f"(or the ShardedOptimizer that shard_optimizer returned), got {type(optimizer).__qualname__}; "
                "pass the optimizer itself (e.g. torch.optim.AdamW(...))"
            )
        if plan is None:
            sharded = isinstance(optimizer, ShardedOptimizer)
            plan = overlap_plan(
                self.policy.plan, clip_grad_norm=clip_grad_norm, scaler=scaler, sharded=sharded, live=live
            )
        elif live and not plan.settings.live:
            raise ConfigError(
                f"{self.tag}overlap_optimizer got a ShardedOptimizer of live mode (copies=2, "
                "defer_gather=True) for a plan without live mode: pass handle.shard_optimizer(optimizer) of "
                "this replica's handle"
            )
        reason = fallback_reason(inner, plan)
        return self.mode.overlap_optimizer(self, optimizer, reason)

    def _check_shard(self, shard: ShardedOptimizer) -> bool:
        """A ShardedOptimizer the engine may step: over this replica's ranks. True for live mode's sharding
        (two copies of each share, the gather deferred: fit's), which the plan's verdict on overlapping in
        live mode (it falls back) decides; one copy gathering in its step otherwise."""
        ours = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        theirs = dist.get_process_group_ranks(shard.group if shard.group is not None else dist.group.WORLD)
        live = shard.copies == 2 and shard.defer_gather
        if ours != theirs or not (live or (shard.copies == 1 and not shard.defer_gather)):
            raise ConfigError(
                f"{self.tag}overlap_optimizer takes the ShardedOptimizer that this replica's "
                f"shard_optimizer() returned (over ranks {ours}, one copy of each share); this one is over "
                f"ranks {theirs} with copies={shard.copies}, defer_gather={shard.defer_gather}: pass "
                "handle.shard_optimizer(optimizer) of this replica's handle"
            )
        return live

    # torch's Joinable protocol (the DDP wrapper and the handle forward to these)
    def join_hook(self, **kwargs: Any) -> EngineJoinHook:
        """A JoinHook for torch's Join manager; kwargs: divide_by_initial_world_size (default True)."""
        self.reducer  # noqa: B018  (raises in deterministic mode, where every rank runs every step)
        self.join_session = JoinSession(bool(kwargs.get("divide_by_initial_world_size", True)))
        return EngineJoinHook(self, self.join_session)

    @property
    def join_device(self) -> torch.device:
        return self.comm_device

    @property
    def join_config(self) -> JoinConfig:
        """torch's join settings (enable, throw_on_early_termination), set by its Join manager."""
        return self._join_config

    @join_config.setter
    def join_config(self, config: JoinConfig) -> None:
        self._join_config = config  # the name torch's Join.notify_join_context reads

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD  # type: ignore[return-value]

    def leave_join(self) -> None:
        """The join() context closed: back to the common path (no per-step record, full-world average)."""
        self.join_session = None
        self.reducer.set_divisor(self.world)

    # what else join.py needs (its JoinReplica protocol)
    def broadcast_buffers_from(self, group_rank: int) -> None:
        """Every rank takes the buffers of `group_rank` (join(): the highest rank still training), hidden
        from autograd's version counters like every forward's buffer sync."""
        buffers = self.buffers
        with preserve_version_counter(tuple(buffers)):
            broadcast_coalesced(buffers, self._global_rank(group_rank), self.group)

    def broadcast_model_from(self, group_rank: int) -> None:
        """Every rank takes the parameters (frozen ones too) and, if the policy broadcasts buffers, the
        buffers of `group_rank` (join()'s end: the replicas leave the context identical)."""
        tensors = self._all_params + (self.buffers if self.policy.broadcast_buffers else [])
        broadcast_coalesced(tensors, self._global_rank(group_rank), self.group)

    def request_forward_param_sync(self) -> None:
        """Broadcast buffers before the next forward (torch's require_forward_param_sync)."""
        self.flags.require_forward_param_sync = True

    def _global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def stats(self) -> EngineStats:
        return self.mode.stats(self.world)

    def remove(self) -> None:
        """Detach the engine: hooks removed, the module is a plain module again."""
        self.mode.remove()

    def accumulate(
        self,
        fn: Callable[[Any], Any],
        micro_batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int,
    ) -> dict[int, Any]:
        """One step of K micro-batches with the mode's reduction (micro_step.py; ReplicaHandle.accumulate)."""
        return self.mode.accumulate(
            self, fn, micro_batches, num_micro_batches=num_micro_batches, step=step, seed=seed
        )

    def owned_micro_batches(self, num_micro_batches: int) -> list[int]:
        """This rank's ordinals of a step of K micro-batches."""
        return self.mode.micro_steps(self).owned(num_micro_batches)


def _sparse_flags(module: nn.Module, params: list[torch.Tensor]) -> list[bool]:
    """Which parameters get sparse gradients: those of nn.Embedding/EmbeddingBag(sparse=True), like torch."""
    sparse_ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }
    return [id(p) in sparse_ids for p in params]


T = TypeVar("T", bound=torch.Tensor)


def _unique_named(items: Iterator[tuple[str, T]]) -> list[tuple[str, T]]:
    # named_parameters() already drops shared tensors; keep the first name like torch does.
    seen: set[int] = set()
    out = []
    for name, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out
