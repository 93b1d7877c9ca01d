"""A checkpoint's entries read from the run's objects, the bytes of its files, and the way back (load_plan).

Two stages, so that a background save can copy in between: `collect` reads every entry from the live
objects (model, optimizer, sampler, plain values) at the step boundary, its tensors still the objects'
own; `encode` turns entries into the files' bytes and what meta.json says of each entry. A blocking save
runs both at once; a background save (`CheckpointManager.save(..., blocking=False)`) puts a CPU copy of
the entries (snapshot.py) between them and encodes on its writer thread.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from lockstep.checkpoint import layout as paths
from lockstep.checkpoint.meta import FORMAT
from lockstep.checkpoint.stateful import (
    for_safetensors,
    gathers_state,
    is_stateful,
    keyed_like,
    module_mismatch,
    placed_like,
    resolve,
    strip_prefix,
    tensor_state,
)
from lockstep.errors import CheckpointError


@dataclass
class Entry:
    """One entry of a checkpoint: a plain value, a tensors-only state (safetensors) or another state_dict."""

    name: str
    kind: str  # "value" | "tensors" | "stateful"
    payload: Any
    type_name: str = ""


def collect(state: Mapping[str, Any]) -> list[Entry]:
    """Every entry of `state` as it is now (tensors are the objects' own: copy them before training goes on)."""
    entries = []
    for name, obj in state.items():
        target = resolve(obj)
        if not is_stateful(obj):
            entries.append(Entry(name, "value", obj))
            continue
        tensors = tensor_state(target)
        if tensors is not None:
            entries.append(Entry(name, "tensors", tensors, type(target).__name__))
        else:
            saved = target.state_dict()
            payload = strip_prefix(saved) if isinstance(target, nn.Module) else saved
            entries.append(Entry(name, "stateful", payload, type(target).__name__))
    return entries


def encode(entries: list[Entry]) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Bytes of every file but meta.json and rng.json, and what meta.json says about each entry."""
    blobs: dict[str, bytes] = {}
    described: dict[str, Any] = {}
    pickled: dict[str, Any] = {}
    for entry in entries:
        if entry.kind == "tensors":
            filename = paths.tensors_filename(entry.name)
            blobs[filename] = safetensors.torch.save(for_safetensors(entry.payload))
            described[entry.name] = {"kind": "tensors", "file": filename, "type": entry.type_name}
            continue
        pickled[entry.name] = entry.payload
        described[entry.name] = {"kind": entry.kind, "file": paths.STATE}
        if entry.kind == "stateful":
            described[entry.name]["type"] = entry.type_name
    if pickled:
        blobs[paths.STATE] = weights_only_bytes(pickled)
    return blobs, described


def weights_only_bytes(pickled: dict[str, Any]) -> bytes:
    """torch.save bytes that torch.load(weights_only=True) can read; else name the entry that cannot be."""

    def dump(obj: Any) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()

    data = dump({"format": FORMAT, "entries": pickled})
    if not _unsafe_globals(data):
        return data
    for name, obj in pickled.items():
        unsafe = _unsafe_globals(dump(obj))
        if unsafe:
            raise CheckpointError(
                f"state[{name!r}] holds objects that torch.load(weights_only=True) refuses to load ({', '.join(unsafe)}); "
                "checkpoints must hold plain data: give that object a state_dict() of tensors, numbers, strings, "
                "lists and dicts"
            )
    raise CheckpointError(
        f"the training state holds objects torch.load(weights_only=True) refuses: {_unsafe_globals(data)}; "
        "checkpoints must hold plain data (tensors, numbers, strings, lists, dicts, state_dict()s)"
    )


def _unsafe_globals(data: bytes) -> list[str]:
    return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))


def load_plan(
    directory: Path, entries: dict[str, Any], state: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """(name, object or None for a plain value, state to load) for every entry; raises before changing anything."""
    pickled: dict[str, Any] = {}
    if any(info["file"] == paths.STATE for info in entries.values()):
        loaded = torch.load(directory / paths.STATE, map_location="cpu", weights_only=True)
        pickled = loaded["entries"]
    plan: list[tuple[str, Any, Any]] = []
    for name, obj in state.items():
        info, target = entries[name], resolve(obj)
        if info["kind"] == "value":
            if is_stateful(obj):
                raise CheckpointError(
                    f"checkpoint {directory} saved {name!r} as a plain value, but state[{name!r}] "
                    f"is a {type(target).__name__} with load_state_dict(); pass the kind of "
                    "object it was saved from, or start a fresh run_dir"
                )
            plan.append((name, None, pickled[name]))
            continue
        if not is_stateful(obj):
            raise CheckpointError(
                f"checkpoint {directory} saved the state_dict() of a {info.get('type')} as "
                f"{name!r}, but state[{name!r}] is a {type(obj).__name__} without load_state_dict(); "
                "pass the object it was saved from, or start a fresh run_dir"
            )
        if info["kind"] == "tensors":
            saved: Any = safetensors.torch.load_file(str(directory / info["file"]), device="cpu")
        else:
            saved = pickled[name]
        if isinstance(target, nn.Module):
            current = target.state_dict()
            problem = module_mismatch(current, saved)
            if problem:
                raise CheckpointError(
                    f"checkpoint {directory} does not fit state[{name!r}] ({type(target).__name__}): "
                    f"{problem}. Load a checkpoint of this model, or start a fresh run_dir"
                )
            saved = keyed_like(saved, current)
        elif not (isinstance(target, torch.optim.Optimizer) or gathers_state(target)):
            saved = placed_like(saved, target.state_dict())  # optimizers move their state to their params
        plan.append((name, target, saved))
    return plan
