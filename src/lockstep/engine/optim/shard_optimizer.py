"""Sharded optimizer state (ZeRO-1): each rank steps, and keeps the state of, its share of the parameters.

`ShardedOptimizer` wraps the user's own optimizer (any torch optimizer whose update of a parameter reads
only that parameter's gradient and state: SGD with momentum, Adam, AdamW, ...). What is partitioned over
the ranks are units (shard_units.py): for an elementwise optimizer (SGD, Adam, AdamW and the other
classes of shard_units.ELEMENTWISE) the large parameters are cut into 1-D pieces of about 1/32 of the
model, so that every rank keeps about 1/world of the state even when one weight dominates the model;
any other optimizer keeps whole parameters. The units are partitioned once, balanced by size and decided
by the parameter sizes alone (`partition`). A step:

1. the gradients are already averaged on every rank: the engine's all-reduce ran during backward (the
   same collective, the same bits, as without sharding);
2. each rank steps the user's optimizer over its own units only: for the step's duration the optimizer's
   param lists hold this rank's units (a piece's gradient a view of its parameter's) and its `state` is
   this rank's share, so it updates, and holds optimizer state for, those units only (1/world of the
   state); its hooks run and LR schedulers see it step, and its own objects are as before afterwards;
3. every rank takes each updated unit from its owner (a broadcast per large unit, in place; the small
   ones packed, one message per owner): an all-gather without a padded buffer, so no memory beyond the
   parameters themselves.

Each element is updated by the same optimizer code from the same gradient and state as in an unsharded
run, so the parameters and the state are bitwise equal to it. The optimizer object stays the user's, so
LR schedulers work unchanged, and the state_dict has the unsharded format: `consolidate_state_dict()`
collects the full state (each owner broadcasts its units' state, tensors as raw bytes and the structure
as JSON, never pickle: runtime/state_transfer.py; the pieces joined per parameter) and `state_dict()`
returns it; `load_state_dict(full)` keeps this rank's share of a full state. A checkpoint therefore holds
the full state, which loads into a sharded run at any world size and into an unsharded optimizer alike.

Live mode (`copies=2, defer_gather=True`, what fit uses under `lockstep run --min-world`): each share is
also stepped and kept by the rank before its owner, so the state takes 2/world of the memory, and a lost
rank's share is rebuilt from the survivor that holds its copy (`regroup()`), exactly. The all-gather
waits for `gather()`, which fit calls after the step counted (runtime/membership/commit.py): no
collective runs between a step's commit and the end of its optimizer step, as without sharding. Two
members that hold the same share lost together take that share with them (StateLostError: resume from
the last checkpoint).

Why an all-reduce and not a reduce-scatter of the gradients: the engine's bucketed all-reduce gives the
same bits as every other lockstep run, and on gloo (torch 2.13, measured on 2 ranks, 16 MiB) a
reduce-scatter saves nothing: `reduce_scatter_tensor` gives the all-reduce's bits because gloo runs it as
an all-reduce and a copy (26 ms against 16 ms), and the list form of `reduce_scatter` (17.5 ms) sums in
another order than the all-reduce at world sizes 3 and 4. The cost is an all-gather of the parameters on
top of the all-reduce (1.5 times its bytes; NCCL's reduce-scatter would make it 1.0).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from lockstep.engine.core.init_sync import broadcast_coalesced
from lockstep.engine.optim.shard_units import (
    ELEMENTWISE,
    ParamGather,
    Units,
    default_piece_numel,
    partition,
    swapped_params,
)
from lockstep.errors import ConfigError, NotSupportedError, StateLostError, UsageError, rank_tag
from lockstep.runtime.collectives import all_gather_object
from lockstep.runtime.state_transfer import broadcast_state


class ShardedOptimizer:
    """The user's optimizer, stepped on this rank's share of the parameters (see the module doc).

    `param_groups`, `defaults`, `zero_grad()` and `step()` behave as the optimizer's own, so GradScaler and
    clip_grad_norm_ take it as they take the optimizer; LR schedulers are built on the optimizer itself
    (`sharded.optimizer`). `state` is this rank's share, keyed by its units (a parameter, or a 1-D piece of
    one: shard_units.py). `copies`: how many ranks step and keep each share (2 in live mode);
    `defer_gather`: step() leaves the all-gather of the parameters to `gather()`; `piece_numel`: the
    elements per piece of a cut parameter (default: about 1/32 of the model, at least 1 MiB of fp32; an
    optimizer not in shard_units.ELEMENTWISE keeps whole parameters).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | None = None,
        copies: int = 1,
        defer_gather: bool = False,
        piece_numel: int | None = None,
    ) -> None:
        _check_arguments(optimizer, copies, piece_numel)
        self.optimizer, self.group, self.copies, self.defer_gather = (
            optimizer,
            process_group,
            copies,
            defer_gather,
        )
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ConfigError(
                "ShardedOptimizer: the optimizer lists a parameter twice; give each parameter to one "
                "param group once"
            )
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._group_of = [g for g, group in enumerate(optimizer.param_groups) for _ in group["params"]]
        elementwise = type(optimizer) in ELEMENTWISE
        self.units = Units(
            self.params, (piece_numel or default_piece_numel(self.params)) if elementwise else None
        )
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)  # this rank's share
        self._layout()
        self._adopt()  # a state built before sharding (Adagrad builds one at once): this rank's share of it
        self._full: dict[str, Any] | None = None  # the last consolidated full state (until the next step)
        self._pending = False  # stepped, not yet gathered (defer_gather)
        self._state_known = True  # False after a live-mode transfer, until regroup() brings the state
        self._aside: dict[int, torch.Tensor] | None = None  # kept units' values, set aside by set_aside()

    def _layout(self) -> None:
        """The shares over the group as it is now: owners, what this rank keeps, the gather of parameters."""
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.owners = partition(self.units.sizes(), self.world)  # per unit
        copies = min(self.copies, self.world)
        self.kept = {u for u, owner in enumerate(self.owners) if (owner - self.rank) % self.world < copies}
        self._kept_params = {self.units.param_of[u] for u in self.kept}
        self._gather = ParamGather(self.units.tensors, self.owners, self.rank)

    def _adopt(self) -> None:
        """Move the optimizer's own state entries (per parameter) into `state`, cut into this rank's kept
        units; the optimizer's own state is left empty (it is never stepped over the whole parameters)."""
        entries = self.optimizer.state
        for i, p in enumerate(self.params):
            entry = entries.pop(p, None)
            if entry and i in self._kept_params:
                kept = [u for u in self.units.of_param[i] if u in self.kept]
                for u, piece in self.units.split_state(i, entry, kept).items():
                    self.state[self.units.tensors[u]] = piece
        entries.clear()

    # ---- what the optimizer's users read ------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def owners_of(self, param: torch.Tensor) -> list[int]:
        """The rank that steps each piece of `param` (one entry for a whole parameter), holds its state and
        sends its value in the all-gather."""
        index = self._index.get(id(param))
        if index is None:
            raise ConfigError(
                f"{rank_tag(self.rank, self.world)}that tensor is not a parameter of this optimizer"
            )
        return [self.owners[u] for u in self.units.of_param[index]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def kept_ids(self) -> set[int]:
        """`id()` of each parameter this rank steps (some piece of it, or all) and holds the state of."""
        return {id(self.params[i]) for i in self._kept_params}

    def stepped_elsewhere(self) -> None:
        """The overlapped step (shard_overlap.py) stepped this rank's share and broadcast the parameters
        itself: a consolidated state collected before it is stale."""
        self._full = None

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Step this rank's units with the optimizer, then all-gather every parameter (a collective; with
        defer_gather, in `gather()`)."""
        if closure is not None:
            raise NotSupportedError(
                "ShardedOptimizer.step(closure): an optimizer that re-evaluates the loss (LBFGS) needs every "
                "parameter's state on one rank; compute the loss before step(), or do not shard"
            )
        self._full = None
        chosen: list[list[int]] = [[] for _ in self.optimizer.param_groups]
        for u in sorted(self.kept):
            chosen[self._group_of[self.units.param_of[u]]].append(u)
        self._step_units(chosen)
        self._pending = True
        if not self.defer_gather:
            self.gather()

    def step_share(self, params: list[list[torch.Tensor]]) -> None:
        """One step of the kept units of `params` (per param group) only: the overlapped step's, bucket by
        bucket (overlapped_optimizer.py); the all-gather is the caller's (shard_overlap.py)."""
        self._step_units(
            [
                [u for p in group for u in self.units.of_param[self._index[id(p)]] if u in self.kept]
                for group in params
            ]
        )

    def _step_units(self, chosen: list[list[int]]) -> None:
        """The optimizer's step() over the units `chosen` (per param group) and this rank's `state`: its
        param lists and state are swapped for the step's duration, so its hooks run and LR schedulers see
        it step, and the user's objects are as they were after it."""
        units = [u for group in chosen for u in group]
        self.units.attach_grads(units)
        tensors = [[self.units.tensors[u] for u in members] for members in chosen]
        try:
            with swapped_params(self.optimizer, tensors, self.state):
                self.optimizer.step()
        finally:
            self.units.detach_grads(units)

    def gather(self) -> None:
        """Every rank takes each parameter's updated value from its owners (nothing when none is pending)."""
        if self._pending and self.world > 1:
            with torch.no_grad():
                self._gather(self.group, self._global)
        self._pending = False

    # ---- the full state: consolidated for a checkpoint, a share kept on load ------------------------------

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Collect the full optimizer state on group rank `to` (every rank: None); a collective.

        Each owner broadcasts its units' state in turn; `state_dict()` on `to` then returns it, per parameter
        (the pieces joined), in the optimizer's own format.
        """
        mine = {u: s for u, s in self._indexed_state().items() if self.owners[u] == self.rank}
        merged: dict[int, Any] = {}
        for owner in range(self.world):
            share = broadcast_state(
                mine if owner == self.rank else None, src=self._global(owner), group=self.group
            )
            if to is None or to == self.rank:
                merged.update(share)
        if to is None or to == self.rank:
            self._full = {
                "state": self._per_param(merged),
                "param_groups": self.optimizer.state_dict()["param_groups"],
            }

    def state_dict(self) -> dict[str, Any]:
        """The full state in the optimizer's own format, as `consolidate_state_dict()` collected it here."""
        if self._full is None:
            raise UsageError(
                f"{rank_tag(self.rank, self.world)}ShardedOptimizer.state_dict() returns the full state that "
                "consolidate_state_dict() collected, and none was collected on this rank since the last step: "
                "call consolidate_state_dict(to=this rank) on every rank first (lockstep's CheckpointManager "
                "does it in save())"
            )
        return self._full

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full optimizer state (sharded or not when saved, at any world size): keep this rank's share.
        A live-mode transfer (`transfer_state_dict()`) loads the param groups; regroup() brings the state."""
        saved = state_dict.get("state", {})
        if not isinstance(saved, dict):
            raise ConfigError(f"an optimizer state_dict's 'state' is a dict, got {type(saved).__name__}")
        mine = {i: s for i, s in saved.items() if int(i) in self._kept_params}
        # through the optimizer's own load: its casts to each parameter's dtype and device, then cut
        self.optimizer.load_state_dict({"state": mine, "param_groups": state_dict["param_groups"]})
        self.state.clear()
        self._adopt()
        self._state_known = not state_dict.get(_FOLLOWS, False)
        self._full = None

    def _indexed_state(self) -> dict[int, dict[str, Any]]:
        """This rank's state entries by unit index."""
        return {u: self.state[t] for u, t in enumerate(self.units.tensors) if t in self.state}

    def _per_param(self, by_unit: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Every unit's state entry (all of them) as the optimizer's per-parameter entries, in parameter order."""
        out: dict[int, dict[str, Any]] = {}
        for i, units in enumerate(self.units.of_param):
            present = [u for u in units if u in by_unit]
            if present:
                out[i] = self.units.merge_state(i, [by_unit[u] for u in present])
        return out

    # ---- live mode: a replacement's transfer, and the shares re-cut after a change of members -------------

    def transfer_state_dict(self) -> dict[str, Any]:
        """What live mode sends a replacement (no collective): the param groups; the state follows in
        regroup(), from the ranks that hold it."""
        return {"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"], _FOLLOWS: True}

    def set_aside(self) -> None:
        """Live mode, before the group changes: when a step's values have not been all-gathered yet, keep
        this rank's kept units aside (the replica rebuilt on the new group takes rank 0's values, which
        are stale for units rank 0 did not step); regroup() puts them back."""
        if self._pending and self._aside is None:
            self._aside = {u: self.units.tensors[u].detach().clone() for u in self.kept}

    def regroup(self) -> None:
        """After the group changed (a member lost, or replacements admitted; every member calls it on the
        new group): the shares re-cut over the new members, each unit's value and state taken from a
        survivor that holds it (its owner or its copy). Raises StateLostError, on every rank, when the
        members that held a share were all lost."""
        tensors = self.units.tensors
        if self._aside is not None:
            with torch.no_grad():
                for u, value in self._aside.items():
                    tensors[u].copy_(value)
        fresh = [self._state_known and (not self._pending or u in self.kept) for u in range(len(tensors))]
        known = [self._state_known and u in self.kept for u in range(len(tensors))]
        self._layout()  # the new group's shares
        reports = all_gather_object({"fresh": fresh, "known": known}, group=self.group)
        values, states = _sources(reports, "fresh"), _sources(reports, "known")
        lost = [u for u in range(len(tensors)) if values[u] is None or states[u] is None]
        if lost:
            raise StateLostError(
                f"{rank_tag(self.rank, self.world)}the members that held the optimizer state (and updated "
                f"values) of {len({self.units.param_of[u] for u in lost})} parameters were all lost together: "
                "those parameters cannot be rebuilt from the survivors; resume from the last checkpoint"
            )
        stale = [u for u in range(len(tensors)) if not all(r["fresh"][u] for r in reports)]
        for src in sorted({cast(int, values[u]) for u in stale}):  # values the step left on their holders
            broadcast_coalesced(
                [tensors[u] for u in stale if values[u] == src], self._global(src), self.group
            )
        local = self._indexed_state()
        kept: dict[int, Any] = {}
        for src in sorted({cast(int, src) for src in states}):
            sent = {u: s for u, s in local.items() if states[u] == src} if src == self.rank else None
            received = broadcast_state(sent, src=self._global(src), group=self.group)
            kept.update({u: s for u, s in received.items() if u in self.kept})
        self.state.clear()
        for u, entry in kept.items():
            self.state[tensors[u]] = self._placed(u, entry)
        self._pending, self._state_known, self._full, self._aside = False, True, None, None

    def _placed(self, unit: int, entry: dict[str, Any]) -> dict[str, Any]:
        """A unit's state entry as received (on the group's device) put where the optimizer keeps it, as
        torch's Optimizer.load_state_dict places it: the step count on the CPU (on the parameter's device
        for a capturable or fused optimizer), the rest on the parameter's device and floating dtype."""
        p = self.params[self.units.param_of[unit]]
        group = self.optimizer.param_groups[self._group_of[self.units.param_of[unit]]]
        on_device = bool(group.get("capturable") or group.get("fused"))
        placed: dict[str, Any] = {}
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                placed[key] = value
            elif key == "step":
                placed[key] = value.to(device=p.device, dtype=torch.float32) if on_device else value.cpu()
            elif p.is_floating_point() and value.is_floating_point():
                placed[key] = value.to(device=p.device, dtype=p.dtype)
            else:
                placed[key] = value.to(device=p.device)
        return placed

    def global_rank(self, group_rank: int) -> int:
        """The global rank of `group_rank` in this optimizer's group (what broadcast's `src` takes)."""
        return self._global(group_rank)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank


def _check_arguments(optimizer: Any, copies: int, piece_numel: int | None) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"ShardedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; pass the "
            "optimizer built on the replicated module's parameters"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("ShardedOptimizer needs a process group: call lockstep.init() first")
    if copies not in (1, 2):
        raise ConfigError(f"ShardedOptimizer(copies={copies!r}): expected 1 or 2 (live mode)")
    if piece_numel is not None and (piece_numel < 1 or type(optimizer) not in ELEMENTWISE):
        raise ConfigError(
            f"ShardedOptimizer(piece_numel={piece_numel!r}): pieces take a positive element count, and an "
            f"optimizer whose update is elementwise ({', '.join(c.__name__ for c in ELEMENTWISE)}); "
            f"{type(optimizer).__name__} is stepped on whole parameters: leave piece_numel out"
        )


_FOLLOWS = "lockstep_state_follows"  # a live-mode transfer: the state comes from regroup()


def _sources(reports: list[dict[str, list[bool]]], key: str) -> list[int | None]:
    """For each parameter, the lowest rank whose report says `key`, or None when no rank does."""
    count = len(reports[0][key])
    return [next((rank for rank, r in enumerate(reports) if r[key][i]), None) for i in range(count)]
