"""The engine's public faces: `DistributedDataParallel` (torch's drop-in) and `replicate` (native, in place)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook, _JoinConfig

from lockstep.engine.join import EngineJoin
from lockstep.engine.policy import DEFAULT_BUCKET_CAP_MB, SyncPolicy
from lockstep.engine.reducer import CommHook
from lockstep.engine.state import ReplicaState
from lockstep.engine.stats import EngineStats
from lockstep.errors import ConfigError


class _JoinableReplica(Joinable):
    """torch's Joinable protocol for both faces of the engine, forwarded to the replica's state.

    `join()` here or torch's `Join([model, ...])` (with ZeroRedundancyOptimizer, say) both work.
    """

    _replica: ReplicaState

    def __init__(self) -> None:  # Joinable's __init__ would set _join_config before the replica exists
        pass

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> EngineJoin:
        """Train on uneven inputs: `with model.join(): for batch in my_batches: ...` (torch's contract).

        Ranks that run out of batches shadow the collectives of those still training until all are
        done; then the replicas are made identical (the last rank to join broadcasts its parameters).
        divide_by_initial_world_size: average over the initial world size (True) or over the ranks still
        training (False). throw_on_early_termination: raise UnevenInputsError on every rank as soon as
        one runs out (needed when forward has collectives of its own, such as SyncBatchNorm).
        """
        return EngineJoin([self], enable, throw_on_early_termination,
                          divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self._replica.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self._replica.join_device

    @property
    def join_process_group(self) -> Any:
        return self._replica.join_process_group

    @property
    def _join_config(self) -> _JoinConfig:
        return self._replica._join_config

    @_join_config.setter
    def _join_config(self, config: _JoinConfig) -> None:
        self._replica._join_config = config


class DistributedDataParallel(nn.Module, _JoinableReplica):
    """Drop-in for torch.nn.parallel.DistributedDataParallel, on lockstep's engine.

    Same arguments and behaviour as torch's class: the wrapped module is `.module`, state_dict keys
    carry the `module.` prefix, `no_sync()` accumulates locally. Differences, all on the side of the user:
    load_state_dict accepts keys with or without the prefix; attributes missing on the wrapper are
    looked up on the wrapped module; different models on different ranks raise an error naming the
    rank and parameter; unused parameters are named; `stats()` reports timings and overlap.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__()
        for name, value in (("delay_all_reduce_named_params", delay_all_reduce_named_params),
                            ("param_to_hook_all_reduce", param_to_hook_all_reduce),
                            ("mixed_precision", mixed_precision), ("device_mesh", device_mesh)):
            if value is not None:
                raise NotImplementedError(f"lockstep.DistributedDataParallel does not support {name} (got {value!r})")
        if dim != 0:
            raise NotImplementedError(f"lockstep.DistributedDataParallel scatters nothing; dim={dim!r} is not used")
        self.module = module
        self.device_ids, self.output_device = _check_devices(module, device_ids, output_device)
        self.dim = dim
        policy = SyncPolicy(
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=True if broadcast_buffers is None else bool(broadcast_buffers),
        )
        self.broadcast_buffers = policy.broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.process_group = process_group
        self._replica = ReplicaState(module, policy, process_group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        compiling = torch.compiler.is_compiling()
        # Under torch.compile of the wrapper the engine's bookkeeping runs eagerly (graph breaks around
        # it) while dynamo compiles the user's module.
        (_eager(self._replica.pre_forward) if compiling else self._replica.pre_forward)()
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), torch.device("cuda", self.device_ids[0]))
        output = self.module(*inputs, **kwargs)
        return (_eager(self._replica.post_forward) if compiling else self._replica.post_forward)(output)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with self._replica.no_sync():
            yield

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """torch's contract: hook(state, bucket) -> Future[Tensor]; call once, before training."""
        self._replica.register_comm_hook(state, hook)

    def stats(self) -> EngineStats:
        return self._replica.stats()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Accepts keys with the `module.` prefix (torch's DDP checkpoints) and without (plain ones)."""
        if state_dict and not any(k.startswith("module.") for k in state_dict):
            state_dict = {f"module.{k}": v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules and name not in ("_replica",):
                return getattr(modules["module"], name)
            raise


class ReplicaHandle(_JoinableReplica):
    """What `replicate` returns: control over a module replicated in place."""

    def __init__(self, replica: ReplicaState, hooks: list[Any]) -> None:
        self._replica, self._hooks = replica, hooks

    @property
    def module(self) -> nn.Module:
        return self._replica.module

    @property
    def policy(self) -> SyncPolicy:
        return self._replica.policy

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside accumulate gradients locally; the next synced backward reduces the sum."""
        with self._replica.no_sync():
            yield

    def stats(self) -> EngineStats:
        """Bucket layout, last step's and mean timings (forward, backward, comm, overlap), bytes sent."""
        return self._replica.stats()

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        self._replica.register_comm_hook(state, hook)

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
    """
    replica = ReplicaState(module, policy or SyncPolicy(), process_group)

    def before(_m: nn.Module, args: Any) -> None:
        replica.pre_forward()

    def after(_m: nn.Module, args: Any, output: Any) -> Any:
        return replica.post_forward(output)

    hooks = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    return ReplicaHandle(replica, hooks)


def _check_devices(
    module: nn.Module, device_ids: Sequence[int | torch.device] | None, output_device: Any
) -> tuple[list[int] | None, Any]:
    devices = {p.device for p in module.parameters()}
    if not device_ids:
        return None, output_device
    if len(device_ids) != 1:
        raise ConfigError(f"device_ids must name one device (one process per device), got {list(device_ids)!r}")
    if any(d.type != "cuda" for d in devices) or len(devices) != 1:
        raise ConfigError(
            f"device_ids={list(device_ids)!r} is for a module on one CUDA device, but its parameters are on "
            f"{sorted(str(d) for d in devices)!r}; pass device_ids=None for CPU modules and for modules "
            "spread over several devices (like torch)"
        )
    index = device_ids[0].index if isinstance(device_ids[0], torch.device) else int(device_ids[0])
    return [index], output_device


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _eager(fn: Any) -> Any:
    import torch._dynamo  # slow to import: only when compiling

    return torch._dynamo.disable(fn)
