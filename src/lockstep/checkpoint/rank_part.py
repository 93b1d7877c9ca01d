"""A checkpoint's entries held rank by rank (`RankStateful`: each rank's own state, which differs from rank to
rank and is never gathered), written by every rank into the sharded part and read back by the rank that wrote it.

Each rank's state goes into the same torch.distributed.checkpoint save as the sharded models, under a key of its
own (`<entry>/rank<r>`, which no model key can be: entry names hold no `/`). DCP dedups a key that several ranks
save (it writes one rank's value), never values under different keys, so every rank's state is written by that
rank. The state is stored as one value, whole (DCP torch.saves a non-tensor value), so that its structure comes
back as it went in: DCP's flattening would turn integer keys (an optimizer's state) into strings and drop empty
dicts. It is read with torch.load(weights_only=True), as every non-tensor value of the sharded part is
(sharded.SafePlanner). A rank reads its own key only, and only at the layout the entry was saved at (meta.json
records it): another layout is refused before anything is loaded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.checkpoint.layout import SHARDED
from lockstep.checkpoint.stateful import RankStateful, resolve
from lockstep.errors import CheckpointError

PER_RANK = "per_rank"  # meta.json's kind of such an entry
_KEY = re.compile(r"^(?P<name>[^/]+)/(?P<rank>rank\d+)$")


def entries(state: Mapping[str, Any]) -> dict[str, RankStateful]:
    """The entries of `state` held rank by rank, by name."""
    found: dict[str, RankStateful] = {}
    for name, obj in state.items():
        target = resolve(obj)
        if isinstance(target, RankStateful):
            found[name] = target
    return found


def key(name: str, rank: int) -> str:
    """The sharded part's key of rank `rank`'s state of entry `name`."""
    return f"{name}/rank{rank}"


def state_dicts(ranked: Mapping[str, RankStateful], rank: int) -> dict[str, Any]:
    """This rank's states, for the sharded part's DCP save. Each is wrapped in a 1-tuple: DCP's flattening
    stops at a tuple and stores it whole."""
    return {key(name, rank): (obj.state_dict(),) for name, obj in ranked.items()}


def describe(ranked: Mapping[str, RankStateful], world_size: int) -> dict[str, Any]:
    """What meta.json says of each entry held rank by rank: its layout, which a load must match."""
    return {
        name: {
            "kind": PER_RANK,
            "file": SHARDED,
            "type": type(obj).__name__,
            "world_size": world_size,
            "layout": obj.rank_layout(),
        }
        for name, obj in ranked.items()
    }


def check(directory: Path, name: str, obj: Any, info: Mapping[str, Any]) -> RankStateful:
    """The object that takes back entry `name` (held rank by rank in the checkpoint); a CheckpointError when it
    is not such an object, or when this run's layout is not the one the entry was saved at."""
    target = resolve(obj)
    if not isinstance(target, RankStateful):
        raise CheckpointError(
            f"checkpoint {directory} holds state[{name!r}] rank by rank (a {info.get('type')}: every rank's own "
            f"state), but state[{name!r}] is a {type(target).__name__}, which does not load such a state; pass "
            "the kind of object it was saved from, or start a fresh run_dir"
        )
    saved = info.get("layout")
    current = json.loads(json.dumps(target.rank_layout()))  # as meta.json gives it back
    if saved != current:
        raise CheckpointError(target.layout_refusal(dict(saved or {})))
    return target


def unpack(directory: Path, name: str, rank: int, loaded: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's state of entry `name`, as the sharded part's read gave it back."""
    value = loaded.get(key(name, rank))
    if not (isinstance(value, tuple) and len(value) == 1 and isinstance(value[0], dict)):
        raise CheckpointError(
            f"checkpoint {directory}: {SHARDED}/ holds no state of rank {rank} for state[{name!r}] (found a "
            f"{type(value).__name__}); the checkpoint is damaged or was not written by this version"
        )
    return value[0]


def regroup(read: Mapping[str, Any]) -> dict[str, Any]:
    """A sharded part read whole (sharded.read_whole) with every rank's state of an entry gathered under the
    entry's name, by rank: {"workers": {"rank0": ..., "rank1": ...}} (what `lockstep compare` walks)."""
    out: dict[str, Any] = {}
    for name, value in read.items():
        match = _KEY.match(name)
        if match and isinstance(value, tuple) and len(value) == 1:
            out.setdefault(match["name"], {})[match["rank"]] = value[0]
        else:
            out[name] = value
    return out
