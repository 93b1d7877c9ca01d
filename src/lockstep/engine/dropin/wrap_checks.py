"""The drop-in class's checks of what it is given, with torch's exception types and messages.

torch's DistributedDataParallel refuses some arguments at wrap time (uninitialized parameters, several
device types, a process group and a device mesh at once, ...), a communication hook of the wrong shape
at registration, and pickling with a group other than the default one. lockstep's drop-in class
(ddp.py) raises the same builtin types, as lockstep errors that subclass them, with torch's words and
a hint on what to do; settings it does not implement are refused as NotImplementedError.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.errors import (
    CommHookTypeError,
    CommHookValueError,
    ConfigError,
    DDPArgumentError,
    NoTrainableParametersError,
    NotSupportedError,
)
from lockstep.torch_private import default_group  # looked up at each use, never held


def check_comm_hook(hook: Any) -> None:
    """torch's checks of a communication hook, with torch's exception types."""
    if not callable(hook):
        raise CommHookTypeError(
            f"Communication hook must be callable. Got {type(hook).__name__} {hook!r}; pass a function "
            "hook(state, bucket) -> torch.futures.Future[torch.Tensor]"
        )
    signature = inspect.signature(hook)
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise CommHookValueError(
            "Communication hook: bucket annotation should be dist.GradBucket. "
            f"{getattr(hook, '__name__', hook)!r} annotates it as {bucket.annotation!r}; annotate "
            "`bucket: dist.GradBucket` or leave it unannotated"
        )
    if signature.return_annotation not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise CommHookValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
            f"{getattr(hook, '__name__', hook)!r} annotates {signature.return_annotation!r}; return the "
            "Future of an async collective, e.g. dist.all_reduce(..., async_op=True).get_future()"
        )


def refuse_unsupported(**settings: Any) -> None:
    """NotImplementedError (NotSupportedError) for the first of torch's settings that is not None."""
    for name, value in settings.items():
        if value is not None:
            raise NotSupportedError(
                f"lockstep.DistributedDataParallel does not support {name} (got {value!r}); leave it None, "
                "or use torch.nn.parallel.DistributedDataParallel for this model (docs/compat.md)"
            )


def resolve_group(
    process_group: dist.ProcessGroup | None, device_mesh: Any
) -> tuple[dist.ProcessGroup | None, Any]:
    """torch's rules: a group, or a 1-D device mesh's group, or (None) the default group."""
    if process_group is not None and device_mesh is not None:
        raise DDPArgumentError(
            "Cannot specify both process_group and device_mesh arguments. Pass one of them "
            "(the mesh's group is device_mesh.get_group(0))"
        )
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise DDPArgumentError(
                f"Only 1D device mesh is supported, but got {device_mesh}. Pass a 1-D mesh, or its "
                "data-parallel dimension (mesh['dp'])"
            )
        return device_mesh.get_group(mesh_dim=0), device_mesh
    return process_group, None


def check_default_group(group: dist.ProcessGroup | None) -> None:
    """torch's rule for pickling (and deep-copying) the drop-in class: the default group only."""
    try:
        is_default = group is not None and group == default_group()
    except (RuntimeError, ValueError):
        is_default = False
    if not is_default:
        raise DDPArgumentError(
            "DDP Pickling/Unpickling are only supported when using DDP with the default process group. "
            "That is, when you have called init_process_group and have not passed process_group argument "
            "to DDP constructor"
        )


def check_parameters(module: nn.Module) -> None:
    """torch's wrap-time checks of the parameters, with torch's exception types."""
    params = list(module.parameters())
    if not any(p.requires_grad for p in params):
        raise NoTrainableParametersError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a "
            f"gradient ({type(module).__name__} has {len(params)} parameter(s), none with requires_grad=True)"
        )
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in params):
        raise DDPArgumentError(
            "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
            "Run a dummy forward pass to correctly initialize the modules"
        )
    device_types = {p.device.type for p in params}
    if len(device_types) > 1:
        raise ConfigError(
            "DistributedDataParallel's input module must be on the same type of devices, but input module "
            f"parameters locate in {device_types}."
        )


def check_devices(
    module: nn.Module, device_ids: Sequence[int | torch.device] | None, output_device: Any
) -> tuple[list[int] | None, Any]:
    """device_ids and output_device as the drop-in class keeps them: one CUDA device's index, or None."""
    devices = {p.device for p in module.parameters()}
    if not device_ids:
        return None, output_device
    if len(device_ids) != 1:
        raise ConfigError(
            f"device_ids must name one device (one process per device), got {list(device_ids)!r}"
        )
    if any(d.type != "cuda" for d in devices) or len(devices) != 1:
        raise ConfigError(
            f"device_ids={list(device_ids)!r} is for a module on one CUDA device, but its parameters are on "
            f"{sorted(str(d) for d in devices)!r}; pass device_ids=None for CPU modules and for modules "
            "spread over several devices (like torch)"
        )
    index = device_ids[0].index if isinstance(device_ids[0], torch.device) else int(device_ids[0])
    return [index], output_device
