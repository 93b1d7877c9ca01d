"""Sharded optimizer state (ZeRO-1): each rank steps, and keeps the state of, its share of the parameters.

`ShardedOptimizer` wraps the user's own optimizer (any torch optimizer whose update of a parameter reads
only that parameter's gradient and state: SGD with momentum, Adam, AdamW, ...). The parameters are
partitioned over the ranks once, balanced by size and decided by the parameter order alone
(`partition`). A step:

1. the gradients are already averaged on every rank: the engine's all-reduce ran during backward (the
   same collective, the same bits, as without sharding);
2. each rank hides the gradients of the parameters it does not keep (`.grad = None`) and steps the user's
   optimizer, which skips a parameter without a gradient and creates no state for it: each rank updates,
   and holds optimizer state for, its own parameters only (1/world of the state);
3. the hidden gradients are put back, and every rank takes each updated parameter from its owner (a
   broadcast per large parameter, in place; the small ones packed, one message per owner): an all-gather
   without a padded buffer, so no memory beyond the parameters themselves.

Each parameter is updated by the same optimizer code from the same gradient and state as in an unsharded
run, so the parameters and the state are bitwise equal to it. The optimizer object stays the user's, so
LR schedulers work unchanged and its state_dict has the unsharded format: `consolidate_state_dict()`
collects the full state (each owner broadcasts its parameters' state, tensors as raw bytes and the
structure as JSON, never pickle: runtime/state_transfer.py) and `state_dict()` returns it;
`load_state_dict(full)` keeps this rank's share of a full state. A checkpoint therefore holds the full
state, which loads into a sharded run at any world size and into an unsharded optimizer alike.

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

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from lockstep.engine.init_sync import broadcast_coalesced
from lockstep.errors import ConfigError, NotSupportedError, StateLostError, UsageError, rank_tag
from lockstep.runtime.collectives import all_gather_object
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.state_transfer import broadcast_state
from lockstep.runtime.waits import wait_tracked


def partition(sizes: Sequence[int], world: int) -> list[int]:
    """The owner rank of each parameter: the largest first, each to the rank with the fewest bytes so far
    (the lowest rank on a tie). A pure function of the sizes in parameter order: every rank computes it."""
    loads = [0] * world
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep parameter order
        owner = min(range(world), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += sizes[index]
    return owners


SMALL_BYTES = 1024 * 1024  # smaller parameters travel packed, one flat message per owner, dtype, device


class ParamGather:
    """Every parameter from its owner, all messages in flight at once: a large parameter broadcast in place
    (no copy, no extra memory), the small ones packed per (owner, device, dtype) into one flat message kept
    from step to step (a few hundred tiny layers would otherwise cost a collective each)."""

    def __init__(self, params: Sequence[torch.Tensor], owners: Sequence[int], rank: int) -> None:
        self.rank = rank
        self.messages: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []  # owner, message, packed
        small: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p, owner in zip(params, owners):
            if p.numel() * p.element_size() >= SMALL_BYTES and p.is_contiguous():
                self.messages.append((owner, p.detach(), []))
            else:
                small.setdefault((owner, p.device, p.dtype), []).append(p)
        for (owner, device, dtype), packed in small.items():
            self.messages.append(
                (owner, torch.empty(sum(p.numel() for p in packed), dtype=dtype, device=device), packed)
            )

    def __call__(self, group: dist.ProcessGroup | None, src: Callable[[int], int]) -> None:
        self.wait(self.launch(group, src))

    def launch(self, group: dist.ProcessGroup | None, src: Callable[[int], int]) -> list[tuple[Any, Any]]:
        """Start every message (the owner packs its small parameters first); `wait()` finishes them."""
        launched = []
        for owner, message, packed in self.messages:
            if packed and owner == self.rank:
                torch.cat([p.detach().reshape(-1) for p in packed], out=message)
            record = PROGRESS.issue("broadcast (sharded optimizer: parameters)", (message,), group)
            launched.append((record, dist.broadcast(message, src=src(owner), group=group, async_op=True)))
        return launched

    def wait(self, launched: list[tuple[Any, Any]]) -> None:
        """Wait for the messages `launch()` started; the receivers unpack the packed ones."""
        for (owner, message, packed), (record, work) in zip(self.messages, launched):
            wait_tracked(record, work)
            if packed and owner != self.rank:
                views = message.split([p.numel() for p in packed])
                torch._foreach_copy_(
                    [p.detach() for p in packed], [v.view_as(p) for v, p in zip(views, packed)]
                )


class ShardedOptimizer:
    """The user's optimizer, stepped on this rank's share of the parameters (see the module doc).

    `param_groups`, `state` (this rank's share), `defaults`, `zero_grad()` and `step()` behave as the
    optimizer's own, so GradScaler and clip_grad_norm_ take it as they take the optimizer; LR schedulers
    are built on the optimizer itself (`sharded.optimizer`). `copies`: how many ranks step and keep each
    share (2 in live mode); `defer_gather`: step() leaves the all-gather of the parameters to `gather()`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        process_group: dist.ProcessGroup | None = None,
        copies: int = 1,
        defer_gather: bool = False,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"ShardedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; pass the "
                "optimizer built on the replicated module's parameters"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("ShardedOptimizer needs a process group: call lockstep.init() first")
        if copies not in (1, 2):
            raise ConfigError(f"ShardedOptimizer(copies={copies!r}): expected 1 or 2 (live mode)")
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
        self._layout()
        for i, p in enumerate(self.params):
            if i not in self.kept:
                optimizer.state.pop(p, None)  # a state built before sharding: keep this rank's share only
        self._full: dict[str, Any] | None = None  # the last consolidated full state (until the next step)
        self._pending = False  # stepped, not yet gathered (defer_gather)
        self._state_known = True  # False after a live-mode transfer, until regroup() brings the state
        self._aside: dict[int, torch.Tensor] | None = (
            None  # kept parameters' values, set aside by set_aside()
        )

    def _layout(self) -> None:
        """The shares over the group as it is now: owners, what this rank keeps, the gather of parameters."""
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.owners = partition([p.numel() * p.element_size() for p in self.params], self.world)
        copies = min(self.copies, self.world)
        self.kept = {i for i, owner in enumerate(self.owners) if (owner - self.rank) % self.world < copies}
        self._gather = ParamGather(self.params, self.owners, self.rank)

    # ---- what the optimizer's users read ------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """This rank's share of the state (the optimizer's own `state`)."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def owner(self, param: torch.Tensor) -> int:
        """The rank that steps `param`, holds its state and sends its value in the all-gather."""
        for p, owner in zip(self.params, self.owners):
            if p is param:
                return owner
        raise ConfigError(
            f"{rank_tag(self.rank, self.world)}that tensor is not a parameter of this optimizer"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def kept_ids(self) -> set[int]:
        """`id()` of each parameter this rank steps (and holds the state of)."""
        return {id(self.params[i]) for i in self.kept}

    def stepped_elsewhere(self) -> None:
        """The overlapped step (shard_overlap.py) stepped this rank's share and broadcast the parameters
        itself: a consolidated state collected before it is stale."""
        self._full = None

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Step this rank's parameters with the optimizer, then all-gather every parameter (a collective;
        with defer_gather, in `gather()`)."""
        if closure is not None:
            raise NotSupportedError(
                "ShardedOptimizer.step(closure): an optimizer that re-evaluates the loss (LBFGS) needs every "
                "parameter's state on one rank; compute the loss before step(), or do not shard"
            )
        self._full = None
        hidden = [(p, p.grad) for i, p in enumerate(self.params) if i not in self.kept]
        for p, _ in hidden:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, grad in hidden:
                p.grad = grad
        self._pending = True
        if not self.defer_gather:
            self.gather()

    def gather(self) -> None:
        """Every rank takes each parameter's updated value from its owner (nothing when none is pending)."""
        if self._pending and self.world > 1:
            with torch.no_grad():
                self._gather(self.group, self._global)
        self._pending = False

    # ---- the full state: consolidated for a checkpoint, a share kept on load ------------------------------

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Collect the full optimizer state on group rank `to` (every rank: None); a collective.

        Each owner broadcasts its parameters' state in turn; `state_dict()` on `to` then returns it.
        """
        local = self.optimizer.state_dict()
        mine = {i: s for i, s in local["state"].items() if self.owners[i] == self.rank}
        merged: dict[int, Any] = {}
        for owner in range(self.world):
            share = broadcast_state(
                mine if owner == self.rank else None, src=self._global(owner), group=self.group
            )
            if to is None or to == self.rank:
                merged.update(share)
        if to is None or to == self.rank:
            self._full = {
                "state": {i: merged[i] for i in sorted(merged)},
                "param_groups": local["param_groups"],
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
        mine = {i: s for i, s in saved.items() if int(i) in self.kept}
        self.optimizer.load_state_dict({"state": mine, "param_groups": state_dict["param_groups"]})
        self._state_known = not state_dict.get(_FOLLOWS, False)
        self._full = None

    # ---- live mode: a replacement's transfer, and the shares re-cut after a change of members -------------

    def transfer_state_dict(self) -> dict[str, Any]:
        """What live mode sends a replacement (no collective): the param groups; the state follows in
        regroup(), from the ranks that hold it."""
        return {"state": {}, "param_groups": self.optimizer.state_dict()["param_groups"], _FOLLOWS: True}

    def set_aside(self) -> None:
        """Live mode, before the group changes: when a step's values have not been all-gathered yet, keep
        this rank's kept parameters aside (the replica rebuilt on the new group takes rank 0's values, which
        are stale for parameters rank 0 did not step); regroup() puts them back."""
        if self._pending and self._aside is None:
            self._aside = {i: self.params[i].detach().clone() for i in self.kept}

    def regroup(self) -> None:
        """After the group changed (a member lost, or replacements admitted; every member calls it on the
        new group): the shares re-cut over the new members, each parameter's value and state taken from a
        survivor that holds it (its owner or its copy). Raises StateLostError, on every rank, when the
        members that held a share were all lost."""
        if self._aside is not None:
            with torch.no_grad():
                for i, value in self._aside.items():
                    self.params[i].copy_(value)
        fresh = [self._state_known and (not self._pending or i in self.kept) for i in range(len(self.params))]
        known = [self._state_known and i in self.kept for i in range(len(self.params))]
        self._layout()  # the new group's shares
        reports = all_gather_object({"fresh": fresh, "known": known}, group=self.group)
        values, states = _sources(reports, "fresh"), _sources(reports, "known")
        lost = [i for i in range(len(self.params)) if values[i] is None or states[i] is None]
        if lost:
            raise StateLostError(
                f"{rank_tag(self.rank, self.world)}the members that held the optimizer state (and updated "
                f"values) of {len(lost)} parameters were all lost together: those parameters cannot be "
                "rebuilt from the survivors; resume from the last checkpoint"
            )
        stale = [i for i in range(len(self.params)) if not all(r["fresh"][i] for r in reports)]
        for src in sorted({cast(int, values[i]) for i in stale}):  # values the step left on their holders
            broadcast_coalesced(
                [self.params[i] for i in stale if values[i] == src], self._global(src), self.group
            )
        local = self.optimizer.state_dict()
        kept: dict[int, Any] = {}
        for src in sorted({cast(int, src) for src in states}):
            sent = {i: s for i, s in local["state"].items() if states[i] == src} if src == self.rank else None
            received = broadcast_state(sent, src=self._global(src), group=self.group)
            kept.update({i: s for i, s in received.items() if i in self.kept})
        self.optimizer.load_state_dict({"state": kept, "param_groups": local["param_groups"]})
        self._pending, self._state_known, self._full, self._aside = False, True, None, None

    def global_rank(self, group_rank: int) -> int:
        """The global rank of `group_rank` in this optimizer's group (what broadcast's `src` takes)."""
        return self._global(group_rank)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank


_FOLLOWS = "lockstep_state_follows"  # a live-mode transfer: the state comes from regroup()


def _sources(reports: list[dict[str, list[bool]]], key: str) -> list[int | None]:
    """For each parameter, the lowest rank whose report says `key`, or None when no rank does."""
    count = len(reports[0][key])
    return [next((rank for rank, r in enumerate(reports) if r[key][i]), None) for i in range(count)]
