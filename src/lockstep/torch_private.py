"""Every private name of torch's that lockstep uses, in one place: what it is, why no public one serves.

torch does not promise these names from one release to the next. Reading them here, and only here, means a
torch upgrade that renames one breaks one module, at import or in tests/unit/test_torch_private.py (which
checks that each exists in the installed torch), instead of a training run somewhere later. Each was
checked on torch 2.13 (the version this project pins and tests); where torch has a public equivalent,
lockstep uses that instead and the name is not here.

| name | torch's | why lockstep needs it |
| --- | --- | --- |
| `FutureBase` | `torch._C.Future` | a comm hook's result is checked as torch's DDP checks it: c10d's futures are not torch.futures.Future |
| `foreach_copy_` | `torch._foreach_copy_` | one kernel launch copies a bucket's gradients (DDP's own reducer copies in C++) |
| `flatten_dense_tensors`, `unflatten_dense_tensors` | `torch._utils` | the start-up broadcast packs a model's tensors as torch's DDP does |
| `preserve_version_counter` | `torch.autograd._unsafe_preserve_version_counter` | copying synced values into parameters must not bump their version (torch's DDP writes them in C++) |
| `BatchNormBase` | `torch.nn.modules.batchnorm._BatchNorm` | the base class of every batch norm (SyncBatchNorm derives from it, as torch's does) |
| `JoinConfig` | `torch.distributed.algorithms.join._JoinConfig` | the attribute torch's Join manager sets on a Joinable |
| `pytree` | `torch.utils._pytree` | moves a batch of any nesting to the device (torch's DDP uses it too) |
| `disable_dynamo`, `eval_frame_callback` | `torch._disable_dynamo`, `torch._C._dynamo.eval_frame` | torch.compile support: frames dynamo must not trace, and whether it traces now |
| `active_ddp_module` / `set_active_ddp_module` | `DistributedDataParallel._active_ddp_module` | dynamo's DDPOptimizer reads the wrapper it splits graphs for there |
| `execution_engine` | `torch.autograd.Variable._execution_engine` | queue_callback: run the reducer's finalization once backward ends |
| `compute_bucket_assignment_by_size` | `torch.distributed._compute_bucket_assignment_by_size` | torch's own bucket layout, bit for bit |
| `default_pg`, `in_coalescing` | `distributed_c10d._world` | the default group without a property's checks, per collective (the hot path) |
| `default_group` | `distributed_c10d._get_default_group` | the default group, raising as torch does when there is none |
| `default_store` | `distributed_c10d._get_default_store` | the hang watchdog opens a connection of its own to the group's store |
| `reset_group_names` | `distributed_c10d._world.group_count` | a failed init_process_group leaves torch's group-name counter one up (only destroying a formed group resets it): the next group would be named apart from its peers' and never meet them |
| `set_group_timeout` | `distributed_c10d._set_pg_timeout` | a live group forms under a short timeout and then keeps the job's own |
| `FSDPAllGather`, `FSDPReduceScatter` | `torch.distributed.fsdp._fully_shard._fsdp_api` | the interfaces of FSDP2's public `set_custom_all_gather` / `set_custom_reduce_scatter` (torch exports the setters, not the classes they take) |
| `dcp_set_element` | `torch.distributed.checkpoint._traverse.set_element` | a weights_only DCP load planner puts a non-tensor value back where DCP's own planner would |
| `DCPEmptyStateDictLoadPlanner` | `torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner` | DCP's own way to read a checkpoint without a model (`lockstep compare` reads a sharded part whole) |
| `dcp_load_state_dict` | `torch.distributed.checkpoint.state_dict_loader._load_state_dict` | the same read in one process with `no_dist=True` (dcp.load would fill a copy of the state dict) |
| `copy_state_dict`, `create_cpu_state_dict` | `torch.distributed._state_dict_utils` | a background save's CPU copy of DTensor shards in reusable (pinned) buffers, DTensors keeping their layout (what torch's async DCP save stages with) |
| `fsdp_unit_params` | `FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params` | the parameters of one FSDP unit in the order FSDP2 lays out its reduce-scatter input (deterministic mode reads that input) |

One more lives in launch/worker.py, which must not import torch (it is the bootstrap of every worker, before
the program imports anything): the name of the excepthook torch installs per rank
(`_distributed_excepthook`), whose closure it reads to print one rank prefix, not one per re-formed group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._dynamo.eval_frame import get_eval_frame_callback as eval_frame_callback
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors
from torch._utils import _unflatten_dense_tensors as unflatten_dense_tensors
from torch.autograd import _unsafe_preserve_version_counter as preserve_version_counter
from torch.distributed import distributed_c10d as _c10d
from torch.distributed._state_dict_utils import _copy_state_dict as copy_state_dict
from torch.distributed._state_dict_utils import _create_cpu_state_dict as create_cpu_state_dict
from torch.distributed.algorithms.join import _JoinConfig as JoinConfig
from torch.distributed.checkpoint._traverse import set_element as dcp_set_element
from torch.distributed.checkpoint.default_planner import (
    _EmptyStateDictLoadPlanner as DCPEmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load_state_dict
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as FSDPAllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as FSDPReduceScatter
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.nn.parallel import DistributedDataParallel as _TorchDDP
from torch.utils import _pytree as pytree

__all__ = [
    "DCPEmptyStateDictLoadPlanner",
    "FSDPAllGather",
    "FSDPReduceScatter",
    "FutureBase",
    "BatchNormBase",
    "JoinConfig",
    "active_ddp_module",
    "compute_bucket_assignment_by_size",
    "copy_state_dict",
    "create_cpu_state_dict",
    "dcp_load_state_dict",
    "dcp_set_element",
    "default_group",
    "default_pg",
    "default_store",
    "disable_dynamo",
    "eval_frame_callback",
    "execution_engine",
    "flatten_dense_tensors",
    "foreach_copy_",
    "fsdp_unit_params",
    "in_coalescing",
    "preserve_version_counter",
    "reset_group_names",
    "pytree",
    "set_active_ddp_module",
    "set_group_timeout",
    "unflatten_dense_tensors",
]

FutureBase = torch._C.Future
foreach_copy_ = torch._foreach_copy_
disable_dynamo = torch._disable_dynamo
compute_bucket_assignment_by_size = dist._compute_bucket_assignment_by_size  # type: ignore[attr-defined]
execution_engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]


def default_pg() -> Any:
    """The default process group or None, without `dist.group.WORLD`'s property (once per collective)."""
    return _c10d._world.default_pg


def in_coalescing(pg: Any) -> bool:
    """Whether a coalescing context (`dist._coalescing_manager`) is open on `pg`."""
    return pg in _c10d._world.pg_coalesce_state


def default_group() -> dist.ProcessGroup:
    """The default process group; raises as torch does when none is initialized."""
    return _c10d._get_default_group()


def default_store() -> Any:
    """The store the default process group was formed over."""
    return _c10d._get_default_store()


def reset_group_names() -> None:
    """Name the next default group as torch names the first one ("0"). torch counts the groups it names
    (`_world.group_count`) and resets the count when the default group is destroyed, so that processes
    re-forming after a failure agree on the name, and on the store keys under it. An init_process_group
    that fails counts too, and no destroy follows: without this, a member whose formation failed while its
    peers' succeeded would name every later group one apart from theirs, and no formation would ever
    complete again (the live-mode stall of benchmarks/results/2026-11-29-chaos.md)."""
    _c10d._world.group_count = 0


def set_group_timeout(timeout: timedelta) -> None:
    """The default group's timeout for its collectives from now on."""
    _c10d._set_pg_timeout(timeout)


def active_ddp_module() -> Any:
    return _TorchDDP._active_ddp_module


def set_active_ddp_module(module: Any) -> None:
    _TorchDDP._active_ddp_module = module


def fsdp_initialized(module: Any) -> bool:
    """Whether FSDP2 ran its lazy initialization on the root `module` (its first forward): before it there
    is no iteration state, and `reset_iter_state()` fails on the missing all-gather state."""
    return module._get_fsdp_state()._is_root is not None


def fsdp_unit_params(module: Any) -> list[Any]:
    """The sharded parameters (DTensors) of the FSDP unit `fully_shard(module)` made, in the order FSDP2
    lays out the unit's reduce-scatter input; [] when the unit holds none."""
    group = module._get_fsdp_state()._fsdp_param_group
    return [] if group is None else [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]
