"""`DistributedDataParallel`: torch's drop-in class on lockstep's engine (torch's arguments, attributes, flags)."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from lockstep.engine.buckets.bucket_launch import CommHook
from lockstep.engine.core.policy import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_MB, SyncPolicy
from lockstep.engine.core.stats import EngineStats
from lockstep.engine.dropin.ddp_logging import logging_data
from lockstep.engine.dropin.joinable import JoinableReplica
from lockstep.engine.dropin.torch_reducer import TorchReducerFace
from lockstep.engine.dropin.wrap_checks import (
    check_comm_hook,
    check_default_group,
    check_devices,
    check_parameters,
    refuse_unsupported,
    resolve_group,
)
from lockstep.engine.replica.state import ReplicaState
from lockstep.errors import NoProcessGroupError, NotSupportedError, TorchInternalAttributeError, UsageError
from lockstep.torch_private import (
    active_ddp_module,
    default_group,
    disable_dynamo,
    eval_frame_callback,
    set_active_ddp_module,
)


class DistributedDataParallel(JoinableReplica, TorchDDP):
    """Drop-in for torch.nn.parallel.DistributedDataParallel, on lockstep's engine.

    A subclass of torch's class (so that `isinstance(model, torch.nn.parallel.DistributedDataParallel)`
    holds and every tool that unwraps DDP by isinstance treats it as torch's), but none of torch's
    reducer runs: torch's constructor is not called and every method that would reach torch's C++
    reducer is lockstep's. Same arguments, attributes and flags as torch's class: `.module`,
    `module.`-prefixed state_dict keys, `no_sync()`, `require_backward_grad_sync`,
    `require_forward_param_sync`, `process_group`, `bucket_bytes_cap`, `_set_static_graph()`.
    docs/compat.md lists every attribute and behaviour. Additions, all on the side of the user:
    load_state_dict accepts keys with or without the prefix; attributes missing on the wrapper are
    looked up on the wrapped module; different models on different ranks raise an error naming the rank
    and parameter; unused parameters are named; `stats()` reports timings and overlap.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
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
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not torch's DDP constructor: it would build torch's reducer
        refuse_unsupported(
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            bucket_cap_mb_list=bucket_cap_mb_list,
        )
        if dim != 0:
            raise NotSupportedError(
                f"lockstep.DistributedDataParallel scatters nothing, so dim={dim!r} has no meaning here; "
                "pass each rank's own batch to forward and leave dim=0"
            )
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                "Please avoid using it.",
                FutureWarning,
                stacklevel=2,
            )
        group, self.device_mesh = resolve_group(process_group, device_mesh)
        check_parameters(module)
        self.module = module
        self.device_ids, self.output_device = check_devices(module, device_ids, output_device)
        self.device_type = next(p.device.type for p in module.parameters())
        self.device = next(p.device for p in module.parameters())
        self.is_multi_device_module = len({p.device for p in module.parameters()}) > 1
        self.dim = dim
        sync_buffers = (
            forward_sync_buffers if forward_sync_buffers is not None else broadcast_buffers is not False
        )
        self.forward_sync_buffers = bool(sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = None
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.broadcast_bucket_size = 250 * 1024 * 1024
        cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self.bucket_bytes_cap = int(cap_mb * 1024 * 1024)
        self.bucket_bytes_cap_list: list[int] = []
        self.bucket_bytes_cap_default = bucket_cap_mb is None
        self._use_python_reducer = False
        # torch's first bucket is 1 MiB only with the default cap; an explicit cap applies to every bucket
        self._policy = SyncPolicy(
            bucket_cap_mb=cap_mb,
            first_bucket_mb=DEFAULT_FIRST_BUCKET_MB if bucket_cap_mb is None else cap_mb,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=self.forward_sync_buffers,
            upcast_half_precision=False,  # torch reduces half-precision gradients in their own dtype
            torch_bucket_layout=True,  # torch's buckets: torch's sums, bit for bit, at any world size
        )
        # The engine gets None for the default group (not the group object), and the wrapper only through a
        # weak proxy (no reference cycle): nothing keeps the group alive past destroy_process_group() or
        # leaves it to the cyclic collector at exit, where gloo's threads abort the process.
        self._replica: ReplicaState | None = ReplicaState(
            module,
            self._policy,
            group,
            flags=weakref.proxy(self),
            init_sync=init_sync,
            init_sync_buffers=forward_sync_buffers is not None or broadcast_buffers is not False,
        )
        self._group = group

    # ---- the engine behind the wrapper (built again, without collectives, after unpickling) ----------

    @property
    def _engine(self) -> ReplicaState:
        replica = self.__dict__.get("_replica")
        if replica is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise NoProcessGroupError(
                    "this DistributedDataParallel was unpickled or copied in a process without a process "
                    "group; call torch.distributed.init_process_group (or lockstep.init) before running it, "
                    "or use its .module"
                )
            replica = ReplicaState(
                self.module, self._policy, None, flags=weakref.proxy(self), init_sync=False
            )
            if self.static_graph:
                replica.reducer.enable_static_graph()
            self.__dict__["_replica"] = replica
        return replica

    def __getstate__(self) -> dict[str, Any]:
        check_default_group(self.process_group)
        state = dict(self.__dict__)
        for transient in ("_replica", "_group", "device_mesh", "_reducer_face"):
            state.pop(transient, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        self.__dict__["_replica"] = None  # rebuilt at the first forward, on the default group, no collectives
        self.__dict__["_group"] = None  # the default group, looked up when read
        self.__dict__["device_mesh"] = None

    # ---- torch's interface --------------------------------------------------------------------------

    @property  # type: ignore[override]
    def process_group(self) -> dist.ProcessGroup | None:
        """The group, as torch's attribute; the default group is looked up when read, never held, so that
        destroy_process_group() really ends it (None once it is destroyed)."""
        group = self.__dict__.get("_group")
        if group is not None:
            return group
        return default_group() if dist.is_available() and dist.is_initialized() else None

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self.__dict__["_group"] = group

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # Under torch.compile of the wrapper, as with torch's DDP, dynamo skips this frame and compiles the
    # module's forward only, split at bucket boundaries; the engine's bookkeeping runs eagerly.
    @disable_dynamo(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Outside torch.compile of the wrapper no dynamo callback is set, nothing would trace the engine's
        # calls, and they need no wrapper of their own (two fewer wrapped calls per step)
        traced = eval_frame_callback() is not None
        before, after = (_before_module, _after_module) if traced else (_plain_before, _plain_after)
        module, inputs, kwargs = before(self, inputs, kwargs)
        # what torch's forward sets for dynamo (compile_support.py), restored however the module returns
        outer = active_ddp_module()
        set_active_ddp_module(self)
        try:
            output = module(*inputs, **kwargs)
        finally:
            set_active_ddp_module(outer)
        return after(self, output)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside keep their gradients local; the first synced backward after reduces the sum."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """torch's contract: hook(state, bucket) -> Future[Tensor]; call once, before training."""
        try:
            check_comm_hook(hook)
            self.__dict__["_comm_hook_name"] = hook.__qualname__  # torch logs it before registering
            self._engine.register_comm_hook(state, hook)
        except (TypeError, ValueError, RuntimeError) as error:
            self.__dict__["_logged_error"] = str(error)  # torch logs it for _get_ddp_logging_data()
            raise

    def _set_static_graph(self) -> None:
        """torch's private switch, as torch: like static_graph=True, before the first iteration."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self._engine.reducer.stats.steps:
            message = (
                "_set_static_graph() should be called before training loop starts: this model already "
                f"ran {self._engine.reducer.stats.steps} synced step(s); pass static_graph=True instead"
            )
            self.__dict__["_logged_error"] = message
            raise UsageError(message)
        self.static_graph = True
        self._policy = dataclasses.replace(self._policy, static_graph=True)
        self._engine.reducer.enable_static_graph()

    def will_sync_module_buffers(self) -> bool:
        return bool(self.require_forward_param_sync and self.forward_sync_buffers and self._engine.buffers)

    def stats(self) -> EngineStats:
        """lockstep's addition: what torch keeps in its private logging data, public.

        Returns:
            An EngineStats: the buckets (sizes, dtypes, parameters, whether rebuilt), the number of
            synced steps, and the last step's and the mean step's forward, backward, communication and
            hidden (overlapped) communication times and bytes sent.
        """
        return self._engine.stats()

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's private debugging dict, from lockstep's facts (ddp_logging.py; stats() has more)."""
        return logging_data(self)

    @property
    def reducer(self) -> TorchReducerFace:
        """torch's `reducer` as frameworks use it (prepare_for_backward, _rebuild_buckets, ...:
        torch_reducer.py), on lockstep's engine."""
        face = self.__dict__.get("_reducer_face")
        if face is None:
            face = self.__dict__["_reducer_face"] = TorchReducerFace(self)
        return face

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """torch's load_state_dict, and lockstep's addition: keys without the `module.` prefix load too.

        Args:
            state_dict: a state dict of the wrapper (`module.`-prefixed keys, torch's DDP checkpoints) or
                of the bare module (plain keys).
            strict: as in torch.
            assign: as in torch.

        Returns:
            torch's result (missing and unexpected keys).

        Raises:
            RuntimeError: as torch's, when keys or shapes do not match under `strict`.
        """
        if state_dict and not any(k.startswith("module.") for k in state_dict):
            state_dict = {f"module.{k}": v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def _has_rebuilt_buckets(self) -> bool:  # type: ignore[override]
        return self._engine.reducer.rebuilt

    @property
    def _module_parameters(self) -> list[nn.Parameter]:  # type: ignore[override]
        return list(self._engine.reducer.params)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules and not name.startswith("__") and name != "_replica":
                try:
                    return getattr(modules["module"], name)
                except AttributeError:
                    if name in _TORCH_INTERNALS:
                        raise TorchInternalAttributeError(
                            f"lockstep.DistributedDataParallel has no {name!r}: it is an internal of torch's C++ "
                            "DDP, which lockstep's engine replaces (see docs/compat.md); use stats() or "
                            "_get_ddp_logging_data() for what the engine did"
                        ) from None
                    raise
            raise


# Attributes of torch's DistributedDataParallel that only its C++ reducer gives meaning to.
_TORCH_INTERNALS = frozenset(
    {
        "logger",
        "_accum_grad_hooks",
        "_bucket_config",
        "_ddp_sink_clone",
        "_delay_grad_buffer",
        "_delay_grad_views",
        "_delay_all_reduce_params",
        "_delay_all_reduce_all_params",
        "_lazy_init_ran",
        "_comm_hooks",
        "use_side_stream_for_tensor_copies",
        "modules_buffers",
        "named_module_buffers",
    }
)


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


def _plain_before(ddp: DistributedDataParallel, inputs: Any, kwargs: Any) -> tuple[nn.Module, Any, Any]:
    ddp._engine.pre_forward()
    if ddp.device_ids:
        inputs, kwargs = _to_device((inputs, kwargs), torch.device("cuda", ddp.device_ids[0]))
    module: nn.Module = ddp._modules["module"]  # type: ignore[assignment]  # ddp.module, no __getattr__
    return module, inputs, kwargs


def _plain_after(ddp: DistributedDataParallel, output: Any) -> Any:
    return ddp._engine.post_forward(output)


# The forward's engine work under torch.compile of the wrapper, never traced by dynamo (the wrapper's
# attributes are not a graph's inputs).
_before_module = disable_dynamo(_plain_before)
_after_module = disable_dynamo(_plain_after)
