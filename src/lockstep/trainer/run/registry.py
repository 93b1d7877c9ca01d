"""One registry for a run's state: named entries, each saved and loaded by its own pair of functions.

Every piece of a run's state (the model, the optimizer or this rank's share of it, the schedule, the
sampler, the counters, the random generators, the outer sync state, the metrics) is registered once, by
its owner, as `(key, load, save)`, the way torchft's `Manager.register_state_dict_fn(key, load, save)`
does. Each entry says which uses it serves (`Use`):

- `CHECKPOINT`: a checkpoint file. `CheckpointManager` stores the entry's object (a `Stateful`) under the
  entry's key: it reaches the object only through checkpoint/stateful.py, which stores a model's tensors
  in safetensors and collects a sharded optimizer's state first. The keys are those of older checkpoints.
- `TRANSFER`: what rank 0 sends a replacement (runtime/state_transfer.py; live mode).
- `MARK`: a rollback's mark (trainer/live/live_rounds.py), kept in host memory and put back later.

`snapshot(use)` and `restore(tree, use)` are the one place where a run's state becomes a tree and back:
fit's run (trainer/run/run_state.py and trainer/run/low_comm.py register its entries), its round marks and
`LiveLoop` all go through them. A tree holds one value per entry of the use, by key, in registration
order, and is restored in that order.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.checkpoint.stateful import Stateful
from lockstep.errors import InternalError


class Use(enum.Flag):
    """What a snapshot of the registry is for (an entry serves one or more)."""

    CHECKPOINT = enum.auto()  # a checkpoint file (CheckpointManager stores the entry's object)
    TRANSFER = enum.auto()  # rank 0's state sent to a replacement
    MARK = enum.auto()  # a rollback's mark, in host memory


RECOVERY = Use.TRANSFER | Use.MARK  # what a recovery needs: a replacement's state, a rollback's mark
EVERY = Use.CHECKPOINT | Use.TRANSFER | Use.MARK


@dataclass(frozen=True)
class Entry:
    """One named piece of a run's state."""

    key: str
    load: Callable[[Any], None]
    save: Callable[[], Any]
    uses: Use
    target: Any  # what a checkpoint stores under `key` (entries of Use.CHECKPOINT)
    required: bool  # restore() raises when a tree lacks it; else the entry is left as it is


class StateRegistry:
    """A run's state entries and their one snapshot and restore (see the module doc)."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}

    def register_state_dict_fn(
        self,
        key: str,
        load: Callable[[Any], None],
        save: Callable[[], Any],
        *,
        uses: Use = RECOVERY,
        target: Any = None,
        required: bool = True,
    ) -> None:
        """Register `key`: `save()` gives its state, `load(state)` puts it back; for `uses`. An entry
        that goes into checkpoints names the object the checkpoint stores (`target`)."""
        if key in self._entries:
            raise InternalError(f"the state entry {key!r} is registered twice")
        if (Use.CHECKPOINT in uses) != (target is not None):
            raise InternalError(
                f"the state entry {key!r}: a checkpoint's entry names its object (target), and only it does"
            )
        self._entries[key] = Entry(key, load, save, uses, target, required)

    def retarget(self, key: str, target: Any, save: Callable[[], Any]) -> None:
        """Entry `key` names another object from now on (a sharded model cut anew over a new group)."""
        self._entries[key] = dataclasses.replace(self._entries[key], target=target, save=save)

    def register(self, key: str, obj: Stateful, *, uses: Use = EVERY) -> None:
        """Register a `Stateful` (an optimizer, a scheduler, a sampler, ...) through its own state_dict()
        and load_state_dict()."""
        target = obj if Use.CHECKPOINT in uses else None
        self.register_state_dict_fn(key, obj.load_state_dict, obj.state_dict, uses=uses, target=target)

    def keys(self, use: Use) -> list[str]:
        return [entry.key for entry in self._select(use)]

    def checkpoint_entries(self) -> dict[str, Any]:
        """The objects a checkpoint stores, by the keys it stores them under (CheckpointManager's
        save() and load() take them)."""
        return {entry.key: entry.target for entry in self._select(Use.CHECKPOINT) if entry.target is not None}

    def snapshot(self, use: Use, *, host: bool = False) -> dict[str, Any]:
        """Every entry of `use`, saved. `host`: a copy whose tensors are on the host (a mark does not take
        device memory, nor change when training goes on)."""
        if Use.CHECKPOINT in use:
            raise InternalError("a checkpoint stores the entries' objects: use checkpoint_entries()")
        tree = {entry.key: entry.save() for entry in self._select(use)}
        return _host_copy(tree) if host else tree

    def restore(
        self, tree: Mapping[str, Any], use: Use, *, copied: bool = False, keys: tuple[str, ...] | None = None
    ) -> None:
        """Load every entry of `use` from `tree` (a snapshot of the same use), in registration order; only
        those of `keys` when given. `copied`: load a copy (the tree may be restored again; a
        load_state_dict may keep what it is given)."""
        if Use.CHECKPOINT in use:
            raise InternalError("a checkpoint loads the entries' objects: use checkpoint_entries()")
        entries = [e for e in self._select(use) if keys is None or e.key in keys]
        missing = [e.key for e in entries if e.required and e.key not in tree]
        if missing:
            raise InternalError(f"a state of {sorted(tree)!r} lacks the entries {missing!r}")
        if copied:
            tree = copy.deepcopy({e.key: tree[e.key] for e in entries if e.key in tree})
        for entry in entries:
            if entry.key in tree:
                entry.load(tree[entry.key])

    def _select(self, use: Use) -> list[Entry]:
        return [entry for entry in self._entries.values() if entry.uses & use]


def _host_copy(tree: Any) -> Any:
    """A copy of a nest of dicts, lists and tuples whose tensors are copied to the host."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: _host_copy(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_host_copy(value) for value in tree)
    return copy.deepcopy(tree)
