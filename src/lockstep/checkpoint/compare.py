"""Bitwise comparison of runs: a hash of a state, and the first tensor where two checkpoints differ.

`state_sha256` hashes a nested state (a state_dict, an optimizer's) in its own key order: each entry's
path, dtype, shape and raw bytes (NaN payloads and the sign of zero included), so equal hashes mean equal
bits. `compare_checkpoints` loads two checkpoints (run directories: their newest checkpoint) with
weights_only=True and walks their entries in order; `lockstep compare A B` prints the verdict and exits
0 (bitwise equal), 1 (different) or 2 (unreadable). The RNG streams and meta.json are not compared: they
record per-rank and per-run facts (world size, times) that legitimately differ, and neither is fit's time
account (`RUN_FACTS`).
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from lockstep.checkpoint.layout import META, SHARDED, STATE, TENSORS_SUFFIX, CheckpointLayout, parse_step
from lockstep.checkpoint.rank_part import regroup
from lockstep.checkpoint.sharded import read_whole
from lockstep.errors import CheckpointError, ConfigError


def flatten(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of a nest of mappings and sequences, in its own order (a mapping's key order)."""
    if isinstance(state, Mapping):
        for key, value in state.items():
            yield from flatten(
                value, f"{prefix}{key}." if not isinstance(value, torch.Tensor) else f"{prefix}{key}"
            )
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from flatten(
                value, f"{prefix}{index}." if not isinstance(value, torch.Tensor) else f"{prefix}{index}"
            )
    else:
        yield prefix.rstrip("."), state


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def state_sha256(state: Any) -> str:
    """sha256 of every leaf of `state` in order: tensors by dtype, shape and bits; other leaves by repr."""
    digest = hashlib.sha256()
    for path, leaf in flatten(state):
        digest.update(path.encode() + b"\0")
        if isinstance(leaf, torch.Tensor):
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode() + _tensor_bytes(leaf))
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Comparison:
    """The verdict: equal, or the first differing entry (path) and how it differs."""

    equal: bool
    compared: int  # leaves compared
    path: str = ""
    detail: str = ""

    def describe(self) -> str:
        if self.equal:
            return f"bitwise equal ({self.compared} entries compared)"
        return f"different: first difference at {self.path}: {self.detail}"


def compare_states(a: Any, b: Any) -> Comparison:
    """Walk two nested states in order; the first leaf whose path, dtype, shape or bits differ."""
    left, right = list(flatten(a)), list(flatten(b))
    for count, ((path_a, leaf_a), (path_b, leaf_b)) in enumerate(zip(left, right)):
        if path_a != path_b:
            return Comparison(False, count, path_a, f"the other has {path_b!r} at this position")
        detail = _leaf_difference(leaf_a, leaf_b)
        if detail:
            return Comparison(False, count, path_a, detail)
    if len(left) != len(right):
        longer, extra = ("first", left) if len(left) > len(right) else ("second", right)
        path = extra[min(len(left), len(right))][0]
        return Comparison(False, min(len(left), len(right)), path, f"only the {longer} has this entry")
    return Comparison(True, len(left))


def _leaf_difference(a: Any, b: Any) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if _tensor_bytes(a) == _tensor_bytes(b):
            return ""
        unequal = int((a != b).sum()) if a.numel() else 0
        if a.is_floating_point():
            gap = float((a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max())
            return f"{unequal} of {a.numel()} elements differ, largest difference {gap:.6g}"
        return f"{unequal} of {a.numel()} elements differ"
    if type(a) is not type(b) or a != b:
        return f"{a!r} vs {b!r}"
    return ""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's entries (its sharded part, tensor files and state.pt), from a step directory or a run
    directory."""
    directory = _checkpoint_dir(Path(path))
    entries: dict[str, Any] = {}
    if (directory / SHARDED).is_dir():  # a sharded run's models and optimizers (and per-rank states), whole
        entries.update(regroup(read_whole(directory)))
    for file in sorted(directory.glob(f"*{TENSORS_SUFFIX}")):
        entries[file.name[: -len(TENSORS_SUFFIX)]] = safetensors.torch.load_file(str(file))
    state_file = directory / STATE
    if state_file.is_file():
        try:
            saved = torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as error:  # a damaged file: say which, do not guess
            raise CheckpointError(
                f"{state_file} cannot be read with torch.load(weights_only=True): {error}"
            ) from None
        entries.update(saved.get("entries", saved) if isinstance(saved, dict) else {"state": saved})
    return entries  # tensor files (the model) first, then the other entries in their saved order


def _checkpoint_dir(path: Path) -> Path:
    if (path / META).is_file():
        return path
    layout = CheckpointLayout(path)
    steps = sorted(
        step
        for entry in (layout.root.iterdir() if layout.root.is_dir() else ())
        if (step := parse_step(entry.name)) is not None and (entry / META).is_file()
    )
    if not steps:
        raise ConfigError(
            f"{str(path)!r} is neither a checkpoint (a step_NNNNNN directory with meta.json) nor a run "
            "directory holding checkpoints/; pass one of those"
        )
    return layout.step_dir(steps[-1])


# Entries that record facts of one run, not its state: fit's time account (runtime/run_account.py: wall times)
RUN_FACTS = frozenset({"goodput"})


def compare_checkpoints(a: str | Path, b: str | Path) -> Comparison:
    """Whether two checkpoints (or the newest of two run directories) hold the same bits (the entries of
    RUN_FACTS aside)."""
    return compare_states(_state_only(load_checkpoint(a)), _state_only(load_checkpoint(b)))


def _state_only(entries: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in entries.items() if name not in RUN_FACTS}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lockstep compare",
        description="Compare two checkpoints bit for bit (a run directory stands for its newest checkpoint). "
        "Exit status: 0 equal, 1 different.",
    )
    parser.add_argument("first")
    parser.add_argument("second")
    args = parser.parse_args(argv)
    result = compare_checkpoints(args.first, args.second)
    print(f"{args.first} vs {args.second}: {result.describe()}")
    return 0 if result.equal else 1
