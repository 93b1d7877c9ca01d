"""Sharded optimizer state (ZeRO-1): each rank steps, and keeps the state of, its share of the parameters.

`ShardedOptimizer` wraps the user's own optimizer (any torch optimizer whose update of a parameter reads
only that parameter's gradient and state: SGD with momentum, Adam, AdamW, ...). The parameters are
partitioned over the ranks once, balanced by size and decided by the parameter order alone
(`partition`). A step:

1. the gradients are already averaged on every rank: the engine's all-reduce ran during backward (the
   same collective, the same bits, as without sharding);
2. each rank hides the gradients of the parameters it does not own (`.grad = None`) and steps the user's
   optimizer, which skips a parameter without a gradient and creates no state for it: each rank updates,
   and holds optimizer state for, its own parameters only (1/world of the state);
3. the updated parameters are all-gathered (one all-gather per dtype and device, each rank's share
   packed into one flat buffer), and the hidden gradients are put back.

Each parameter is updated by the same optimizer code from the same gradient and state as in an unsharded
run, so the parameters and the state are bitwise equal to it. The optimizer object stays the user's, so
LR schedulers work unchanged and its state_dict has the unsharded format: `consolidate_state_dict()`
collects the full state (each owner broadcasts its parameters' state, tensors as raw bytes and the
structure as JSON, never pickle: runtime/state_transfer.py) and `state_dict()` returns it;
`load_state_dict(full)` keeps this rank's share of a full state. A checkpoint therefore holds the full
state, which loads into a sharded run at any world size and into an unsharded optimizer alike.

Why an all-reduce and not a reduce-scatter of the gradients: the engine's buckets are laid out by the
backward's order, not by owner, and the point of its bucketed all-reduce is the same bits as every
other lockstep run. On gloo (torch 2.13) `reduce_scatter_tensor` gives the bits of the all-reduce of the
same flat buffer, but the list form of `reduce_scatter` does not at world sizes 3 and 4. The cost is
communication: an all-reduce plus an all-gather of the parameters, 1.5 times the bytes of the plain
all-reduce, where a reduce-scatter would need 1.0 times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import ConfigError, NotSupportedError, UsageError, rank_tag
from lockstep.runtime.state_transfer import broadcast_state
from lockstep.runtime.waits import tracked, wait_watching_membership


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


class _Gather:
    """The all-gather of one (device, dtype)'s parameters: each rank's share packed into one flat row."""

    def __init__(self, shares: list[list[torch.Tensor]], rank: int) -> None:
        self.shares, self.rank = shares, rank
        self.width = max(sum(p.numel() for p in share) for share in shares)
        first = next(p for share in shares for p in share)
        self.rows = torch.empty(len(shares), self.width, dtype=first.dtype, device=first.device)

    def __call__(self, group: dist.ProcessGroup | None) -> None:
        rows, mine = self.rows, self.shares[self.rank]
        if mine:
            torch.cat([p.detach().reshape(-1) for p in mine], out=rows[self.rank, : _numel(mine)])
        with tracked("all_gather (sharded optimizer: parameters)", (rows[self.rank],), group):
            work = dist.all_gather(list(rows), rows[self.rank].clone(), group=group, async_op=True)
            wait_watching_membership(work)
        for owner, share in enumerate(self.shares):
            if owner == self.rank or not share:
                continue
            views = rows[owner, : _numel(share)].split([p.numel() for p in share])
            torch._foreach_copy_([p.detach() for p in share], [v.view_as(p) for v, p in zip(views, share)])


def _numel(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


class ShardedOptimizer:
    """The user's optimizer, stepped on this rank's share of the parameters (see the module doc).

    `param_groups`, `state` (this rank's share), `defaults`, `zero_grad()` and `step()` behave as the
    optimizer's own, so GradScaler and clip_grad_norm_ take it as they take the optimizer; LR schedulers
    are built on the optimizer itself (`sharded.optimizer`).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, process_group: dist.ProcessGroup | None = None
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"ShardedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}; pass the "
                "optimizer built on the replicated module's parameters"
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("ShardedOptimizer needs a process group: call lockstep.init() first")
        self.optimizer, self.group = optimizer, process_group
        self.rank, self.world = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ConfigError(
                f"{rank_tag(self.rank, self.world)}the optimizer lists a parameter twice; give each "
                "parameter to one param group once"
            )
        self.owners = partition([p.numel() * p.element_size() for p in self.params], self.world)
        self.owned = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
        for p, owner in zip(self.params, self.owners):
            if owner != self.rank:
                optimizer.state.pop(p, None)  # a state built before sharding: keep this rank's share only
        self._gathers = self._plan_gathers()
        self._full: dict[str, Any] | None = None  # the last consolidated full state (until the next step)

    def _plan_gathers(self) -> list[_Gather]:
        by_kind: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
        for p, owner in zip(self.params, self.owners):
            shares = by_kind.setdefault((p.device, p.dtype), [[] for _ in range(self.world)])
            shares[owner].append(p)
        return [_Gather(shares, self.rank) for shares in by_kind.values()]

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
        """The rank that steps `param` and holds its state."""
        for p, owner in zip(self.params, self.owners):
            if p is param:
                return owner
        raise ConfigError(
            f"{rank_tag(self.rank, self.world)}that tensor is not a parameter of this optimizer"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Step this rank's parameters with the optimizer, then all-gather every parameter (a collective)."""
        if closure is not None:
            raise NotSupportedError(
                "ShardedOptimizer.step(closure): an optimizer that re-evaluates the loss (LBFGS) needs every "
                "parameter's state on one rank; compute the loss before step(), or do not shard"
            )
        self._full = None
        hidden = [(p, p.grad) for p, owner in zip(self.params, self.owners) if owner != self.rank]
        for p, _ in hidden:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, grad in hidden:
                p.grad = grad
        if self.world > 1:
            with torch.no_grad():
                for gather in self._gathers:
                    gather(self.group)

    # ---- the full state: consolidated for a checkpoint, a share kept on load ------------------------------

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Collect the full optimizer state on group rank `to` (every rank: None); a collective.

        Each rank broadcasts its parameters' state in turn; `state_dict()` on `to` then returns it.
        """
        local = self.optimizer.state_dict()
        merged: dict[int, Any] = {}
        for owner in range(self.world):
            src = dist.get_global_rank(self.group, owner) if self.group is not None else owner
            share = broadcast_state(local["state"] if owner == self.rank else None, src=src, group=self.group)
            if to is None or to == self.rank:
                merged.update(share)
        if to is None or to == self.rank:
            full = {"state": {i: merged[i] for i in sorted(merged)}, "param_groups": local["param_groups"]}
            self._full = full

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
        """Load a full optimizer state (sharded or not when saved, at any world size): keep this rank's share."""
        saved = state_dict.get("state", {})
        if not isinstance(saved, dict):
            raise ConfigError(f"an optimizer state_dict's 'state' is a dict, got {type(saved).__name__}")
        mine = {
            i: s
            for i, s in saved.items()
            if 0 <= int(i) < len(self.owners) and self.owners[int(i)] == self.rank
        }
        self.optimizer.load_state_dict({**state_dict, "state": mine})
        self._full = None
