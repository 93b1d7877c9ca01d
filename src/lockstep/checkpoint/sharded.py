"""The sharded part of a checkpoint: models whose parameters are DTensors (torch's FSDP2 and HSDP, `fully_shard`
on a DeviceMesh) and their optimizers, written by every rank through torch.distributed.checkpoint (DCP).

Every rank writes its own shards into the checkpoint's `sharded/` directory (DCP's files `__<rank>_0.distcp`
and `.metadata`); nothing is gathered to rank 0. The state is taken with torch's
`get_state_dict(model, optimizer)`, so the optimizer's state is keyed by parameter name (FQN), not by
position: a checkpoint loads at any layout (another mesh, HSDP, or a plain replicated model and optimizer,
which read the full tensors). A replicated checkpoint (rank 0's `model.safetensors` and an optimizer keyed by
parameter index in `state.pt`) loads into a sharded run through `set_state_dict(..., full_state_dict=True)`
once its index keys are named after the model's parameters.

Every rank writes into and reads from the same directory: a run on several nodes needs `run_dir` on a file
system that every node sees (NFS, Lustre, ...), as replicated checkpoints do for loading.

Loading keeps torch.load(weights_only=True)'s promise: DCP's `.metadata` is read with an unpickler that knows
only DCP's metadata classes, and its non-tensor values (the optimizer's param_groups) with weights_only=True.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from lockstep.checkpoint.layout import SHARDED
from lockstep.checkpoint.stateful import PREFIX, module_mismatch, resolve
from lockstep.checkpoint.storage import FileRecord, sha256_file
from lockstep.errors import CheckpointError, InternalError
from lockstep.torch_private import DCPEmptyStateDictLoadPlanner, dcp_load_state_dict, dcp_set_element

DCP_METADATA = ".metadata"


@dataclass
class Pair:
    """A model entry and the optimizer entry whose parameters are the model's (None: a model alone)."""

    model_name: str
    module: nn.Module  # the bare module (no `module.` wrapper), whose parameter names are the FQNs
    optimizer_name: str | None = None
    optimizer: torch.optim.Optimizer | None = None

    @property
    def names(self) -> list[str]:
        return [self.model_name] + ([self.optimizer_name] if self.optimizer_name else [])


@dataclass
class Pairs:
    """Every model entry of a state, paired with its optimizer; `sharded`: those whose parameters are DTensors."""

    all: list[Pair] = field(default_factory=list)

    @property
    def sharded(self) -> list[Pair]:
        return [p for p in self.all if is_sharded(p.module)]

    def of(self, name: str) -> Pair | None:
        return next((p for p in self.all if name in p.names), None)


def is_sharded(obj: Any) -> bool:
    """Whether `obj` (an entry of a state) is a module with DTensor parameters (FSDP2, HSDP, tensor parallel)."""
    module = resolve(obj)
    return isinstance(module, nn.Module) and any(isinstance(p, DTensor) for p in module.parameters())


def bare_module(module: nn.Module) -> nn.Module:
    """The module inside wrappers whose names all start with `module.` (DDP, lockstep's): its names are the
    FQNs a sharded checkpoint uses."""
    while isinstance(inner := getattr(module, "module", None), nn.Module):
        names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        if not names or not all(n.startswith(PREFIX) for n in names):
            break
        module = inner
    return module


def pair_entries(state: Mapping[str, Any]) -> Pairs:
    """Each module entry of `state` with the optimizer entry whose parameters it holds (an optimizer whose
    parameters belong to no module entry, or two optimizers of one module, are left unpaired)."""
    pairs = Pairs()
    owners: dict[int, Pair] = {}
    for name, obj in state.items():
        target = resolve(obj)
        if isinstance(target, nn.Module):
            pair = Pair(name, bare_module(target))
            pairs.all.append(pair)
            for param in target.parameters():
                owners.setdefault(id(param), pair)
    for name, obj in state.items():
        target = resolve(obj)
        if not isinstance(target, torch.optim.Optimizer):
            continue
        params = [p for group in target.param_groups for p in group["params"]]
        found = {id(owners[id(p)]): owners[id(p)] for p in params if id(p) in owners}
        if len(found) == 1 and all(id(p) in owners for p in params):
            pair = next(iter(found.values()))
            if pair.optimizer is None:
                pair.optimizer_name, pair.optimizer = name, target
    return pairs


def unpaired_optimizer(state: Mapping[str, Any], pairs: Pairs) -> str | None:
    """An optimizer entry holding DTensor parameters that no model entry of the state pairs with, or None."""
    paired = {p.optimizer_name for p in pairs.all}
    for name, obj in state.items():
        target = resolve(obj)
        if isinstance(target, torch.optim.Optimizer) and name not in paired:
            if any(isinstance(p, DTensor) for g in target.param_groups for p in g["params"]):
                return name
    return None


# ---- save -----------------------------------------------------------------------------------------------


def state_dicts(pairs: list[Pair]) -> dict[str, Any]:
    """{model entry: its state, optimizer entry: its FQN-keyed state} for DCP (DTensors: this rank's shards)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if pair.optimizer is not None and pair.optimizer_name is not None:
            out[pair.model_name], out[pair.optimizer_name] = get_state_dict(pair.module, pair.optimizer)
        else:
            out[pair.model_name] = get_model_state_dict(pair.module)
    return out


def describe(pairs: list[Pair]) -> dict[str, Any]:
    """What meta.json says of each entry of the sharded part."""
    described: dict[str, Any] = {}
    for pair in pairs:
        described[pair.model_name] = {"kind": SHARDED, "file": SHARDED, "type": type(pair.module).__name__}
        if pair.optimizer_name is not None:
            described[pair.optimizer_name] = {
                "kind": SHARDED,
                "file": SHARDED,
                "type": type(pair.optimizer).__name__,
                "model": pair.model_name,
            }
    return described


def write(
    state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None, rank: int, world: int
) -> dict[str, dict[str, Any]]:
    """Every rank of `group`: write its shards of `state` into `directory` (a collective); the size and
    sha256 of this rank's share of the part's files (file names relative to the checkpoint directory)."""
    # A shard that several ranks hold (HSDP's replica groups, or a periodic sync's, which differ mid-round) is
    # written by the lowest of them: the part holds replica group 0's values whole, never a splice of groups
    planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    metadata = dcp.save(
        state, storage_writer=dcp.FileSystemWriter(directory), planner=planner, process_group=group
    )
    names = sorted({info.relative_path for info in (metadata.storage_data or {}).values()} | {DCP_METADATA})
    records = {}
    for name in names[rank::world]:  # the hashing shared out: each rank reads about 1/world of the part
        path = directory / name
        records[f"{SHARDED}/{name}"] = FileRecord(path.stat().st_size, sha256_file(path)).to_json()
    return records


def describe_failure(exc: BaseException, rank: int) -> str:
    """A failure of rank `rank`'s write in one line per failed rank: DCP's own (raised on every rank) names
    the ranks that failed, without its tracebacks."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {where}: {type(wrapped[0]).__name__}: {wrapped[0]}"
            for where, wrapped in sorted(failures.items())
        )
    return f"rank {rank}: {type(exc).__name__}: {exc}"


# ---- load -----------------------------------------------------------------------------------------------


_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` holds only its own dataclasses, torch.Size, dtypes and paths: nothing else loads."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch.distributed.checkpoint.metadata":
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:  # its own classes, nothing it imports
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{DCP_METADATA} refers to {module}.{name}, which a checkpoint may not hold")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose `.metadata` is unpickled with an allow-list (weights_only's promise)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / DCP_METADATA
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner reading non-tensor values (param_groups) with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _WholePlanner(SafePlanner, DCPEmptyStateDictLoadPlanner):
    """SafePlanner reading everything the metadata lists into new whole tensors (DCP's own way to read a
    checkpoint without a model)."""


def read_whole(directory: Path) -> dict[str, Any]:
    """A checkpoint's sharded part, whole, in this process alone (no collective): {entry: its state}."""
    state: dict[str, Any] = {}  # filled by the planner (dcp.load would fill a copy)
    with warnings.catch_warnings():  # DCP warns that it reads in one process: what is asked of it here
        warnings.simplefilter("ignore", UserWarning)
        dcp_load_state_dict(state, SafeReader(directory / SHARDED), planner=_WholePlanner(), no_dist=True)
    return state


def saved_shapes(directory: Path) -> dict[str, list[int]]:
    """The shape of every tensor of a checkpoint's sharded part, by DCP key ('model.0.weight', ...)."""
    metadata = SafeReader(directory / SHARDED).read_metadata()
    return {
        key: list(info.size)
        for key, info in metadata.state_dict_metadata.items()
        if isinstance(info, TensorStorageMetadata)
    }


def check_model(directory: Path, name: str, current: Mapping[str, Any], shapes: dict[str, list[int]]) -> None:
    """A CheckpointError naming the mismatch when the sharded part's `name` does not fit this model's state."""
    prefix = f"{name}."
    saved = {
        k[len(prefix) :]: torch.empty(s, device="meta") for k, s in shapes.items() if k.startswith(prefix)
    }
    problem = module_mismatch(current, saved)
    if problem:
        raise CheckpointError(
            f"checkpoint {directory} does not fit state[{name!r}]: {problem}. Load a checkpoint of this "
            "model, or start a fresh run_dir"
        )


def empty_like_state(state: Any) -> Any:
    """A state of the same structure whose tensors are new (DTensors stay DTensors of the same layout): DCP
    loads into them, and the objects change only once everything was read."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v) for v in state]
    return state


def read(directory: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Every rank: the sharded part's values for `template`'s entries, in tensors of `template`'s layout
    (DTensors get this rank's shards, plain tensors the whole tensor); a collective."""
    loaded = empty_like_state(template)
    try:
        dcp.load(loaded, storage_reader=SafeReader(directory / SHARDED), planner=SafePlanner())
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(
            f"reading {directory / SHARDED} failed: {describe_failure(exc, dist.get_rank())}"
        ) from exc
    return loaded


def apply(
    pair: Pair, model_state: dict[str, Any], optimizer_state: dict[str, Any] | None, *, full: bool
) -> None:
    """Put the loaded states into the pair's model and optimizer (`full`: whole tensors, sliced into this
    rank's shards where the model is sharded)."""
    options = StateDictOptions(full_state_dict=full)
    if pair.optimizer is not None and optimizer_state is not None:
        set_state_dict(
            pair.module,
            pair.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
            options=options,
        )
    else:
        set_model_state_dict(pair.module, model_state, options=options)


def named_optimizer_state(saved: Mapping[str, Any], pair: Pair, directory: Path) -> dict[str, Any]:
    """A replicated checkpoint's optimizer state (keyed by parameter index) keyed by the model's parameter
    names, matched through this optimizer's own parameter order (groups and positions must agree)."""
    if pair.optimizer is None:  # prepare() reads an optimizer entry only with its optimizer's pair
        raise InternalError(
            f"checkpoint {directory}: an optimizer's state was read for {pair.model_name!r}, which has none"
        )
    names = {id(p): n for n, p in pair.module.named_parameters()}
    groups, saved_groups = pair.optimizer.param_groups, list(saved.get("param_groups", []))
    counts, saved_counts = [len(g["params"]) for g in groups], [len(g["params"]) for g in saved_groups]
    if counts != saved_counts:
        raise CheckpointError(
            f"checkpoint {directory}: the optimizer {pair.optimizer_name!r} was saved with parameter groups "
            f"of {saved_counts} parameters, this one has {counts}: load a checkpoint of this model and optimizer"
        )
    fqn: dict[Any, str] = {}
    for group, saved_group in zip(groups, saved_groups):
        for param, index in zip(group["params"], saved_group["params"]):
            fqn[index] = names[id(param)]
    return {
        "state": {fqn[index]: value for index, value in saved.get("state", {}).items()},
        "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in saved_groups],
    }
