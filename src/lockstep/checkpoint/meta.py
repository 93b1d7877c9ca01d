"""meta.json: what a checkpoint directory holds (step, world size, versions, each file's size and sha256).

It is written last, so a directory without a readable meta.json is a partial checkpoint; `validate`
checks every file against it before a checkpoint may be loaded.
"""

from __future__ import annotations

import json
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy
import safetensors
import torch

from lockstep.checkpoint import layout as paths
from lockstep.checkpoint.storage import sha256_file
from lockstep.errors import CheckpointError

FORMAT = "lockstep-checkpoint"
FORMAT_VERSION = 2  # the newest this version reads: 2 has a sharded part (older versions refuse it), 1 not
SHARDED_METADATA = f"{paths.SHARDED}/.metadata"  # the sharded part's index (DCP's), written after every shard


def describe(
    step: int, world_size: int, entries: dict[str, Any], files: dict[str, Any], *, sharded: bool = False
) -> dict[str, Any]:
    """meta.json's content. `sharded`: the checkpoint has a sharded part (its directory `sharded/`, every
    file of it in `files`)."""
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": 2 if sharded else 1,
        "step": step,
        "world_size": world_size,
        "created_unix": round(time.time(), 3),
        "versions": _versions(),
        "entries": entries,
        "files": files,
    }
    if sharded:
        meta["sharded"] = paths.SHARDED
    return meta


def _versions() -> dict[str, str]:
    try:
        lockstep_version = metadata.version("lockstep")
    except metadata.PackageNotFoundError:
        lockstep_version = "unknown"
    return {
        "lockstep": lockstep_version,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def read_meta(directory: Path) -> dict[str, Any]:
    try:
        meta = json.loads((directory / paths.META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {directory / paths.META}: {exc}") from exc
    if (
        not isinstance(meta, dict)
        or meta.get("format") != FORMAT
        or not {"files", "entries", "world_size"} <= set(meta)
    ):
        raise CheckpointError(f"{directory / paths.META} is not a lockstep checkpoint description")
    return meta


def validate(directory: Path, step: int) -> str | None:
    """Why checkpoint `directory` cannot be used (partial, damaged), or None when every checksum matches."""
    try:
        meta = read_meta(directory)
    except CheckpointError as exc:
        return f"{paths.META} missing or unreadable, the checkpoint is partial ({exc.__cause__ or exc})"
    if meta.get("step") != step or meta.get("format_version", 0) > FORMAT_VERSION:
        return f"{paths.META} says step {meta.get('step')!r}, format {meta.get('format_version')!r}"
    for name, record in meta["files"].items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != record["bytes"]:
            return f"{name} has {size} bytes where meta.json says {record['bytes']} (truncated?)"
        if sha256_file(path) != record["sha256"]:
            return f"the sha256 of {name} does not match meta.json (damaged)"
    for required in (paths.RNG,) + ((SHARDED_METADATA,) if meta.get("sharded") else ()):
        if required not in meta["files"]:
            return f"{required} is not listed in meta.json"
    return None
