"""fit's side of low-communication training (FitConfig.sync): the engine's policy, every rank's state in checkpoints.

`engine_policy` turns the run's settings into the replica's SyncPolicy (engine/periodic/outer_sync.py does the
rounds); `PeriodicRun` holds what a periodic run adds to fit: the handle that syncs after each optimizer
step (a replica's, or a sharded model's: ShardPolicy.sync), and its checkpoint entries.

Between outer syncs the replicas differ: each has its own parameters, and always its own inner
optimizer state (DiLoCo never averages the inner AdamW moments). A rank-0 checkpoint of one replica
could not resume the others exactly, so with `sync` other than "allreduce" the checkpoint also holds
every rank's parameters and optimizer state (`workers`), gathered to rank 0 with tensor collectives
(nothing is pickled over the network), and the outer state (`outer`: the anchor and the outer
momentum, the same on every rank). On resume at the same world size each rank takes its own back; at
another world size only from a round's end (every replica equal; WorkerStates says who takes what).

The gather relies on every rank's state having the same structure as rank 0's: the same model and the
same optimizer, stepped the same number of times, which the lockstep of the steps guarantees.

A sharded periodic run (replica groups of FSDP2 shards meeting every H steps) has no such structure to
gather: inside a group every rank holds other rows (uneven ones too), and the outer state (anchors, outer
momentum, means in flight) is kept on each rank's local shards. Its one entry, `workers` (ShardedWorkers),
is held rank by rank (checkpoint/rank_part.py): every rank writes its own shards, inner optimizer state and
outer state into the sharded part and reads them back itself, at the same world size and shard degree only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep.checkpoint.compare import state_sha256
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.sync_algorithms import is_periodic
from lockstep.engine.periodic.outer_sync import local_shard
from lockstep.engine.sharded.handle import ShardHandle
from lockstep.errors import ConfigError
from lockstep.plan import QUANTIZED_SYNC_DTYPES
from lockstep.runtime.collectives import comm_device
from lockstep.runtime.waits import tracked
from lockstep.trainer.settings.config import FitConfig

# FitConfig.sync_dtype to SyncPolicy.delta_dtype: the casts as dtypes, the quantized formats by name
_DTYPES: dict[str, torch.dtype | str | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPES.update({name: name for name in QUANTIZED_SYNC_DTYPES})


def engine_policy(config: FitConfig) -> SyncPolicy:
    """The replica's policy for fit's micro-batched steps (exact in deterministic mode, float sums
    otherwise), or for low-communication training (deterministic: the outer sums in rank order). Every
    sync runs in live mode too: trainer/live/live_rounds.py says what a lost member costs in each (the
    run's plan refused a warm-up there at the door)."""
    if not is_periodic(config.sync):
        return SyncPolicy(deterministic=config.deterministic)
    return SyncPolicy(
        deterministic=config.deterministic,
        sync=config.sync,
        sync_every=config.sync_every,
        outer_lr=config.outer_lr,
        outer_momentum=config.outer_momentum,
        warmup_steps=config.sync_warmup,
        outer_momentum_warmup=config.outer_momentum_warmup,
        mix=config.fragment_mix,
        fragment_layout=config.fragment_layout,
        fragment_delay=config.fragment_delay,
        fragments=config.fragments,
        delta_dtype=_DTYPES[config.sync_dtype],
    )


class PeriodicRun:
    """What a low-communication run adds to fit: its handle and its checkpoint entries (a replica's: `workers`,
    gathered to rank 0, and `outer`; a sharded model's: `workers` alone, held rank by rank)."""

    def __init__(self, handle: Any, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.handle = handle
        self.sharded = isinstance(handle, ShardHandle)
        self.workers: WorkerStates | ShardedWorkers
        self.outer: OuterState | None
        if self.sharded:
            algorithm = handle.sync_policy.algorithm if handle.sync_policy is not None else None
            # a streaming mean in flight is saved as this rank's contribution (sent again on load), not
            # waited for, as the replicated run's `outer` entry does
            streaming = algorithm is not None and algorithm.delayed
            self.workers, self.outer = ShardedWorkers(module, optimizer, handle, wait=not streaming), None
        else:
            self.workers = WorkerStates(module, optimizer, at_round_end=self.at_round_end)
            self.outer = OuterState(handle)
        self.final_merge_applied = False

    def at_round_end(self) -> bool:
        """Every replica equal: the last inner step ended a round (local_sgd and diloco; streaming DiLoCo's
        replicas never are, its fragments' outer steps being merged into values that moved on)."""
        policy = self.handle.sync_policy
        if policy is None:
            return True  # every step syncs
        inner_steps = int(self.handle.stats().extras["inner_steps"])
        algorithm = policy.algorithm
        warmup = int(self.handle.stats().extras["warmup_steps"])
        if inner_steps <= warmup:
            return True  # the data-parallel warm-up: every step keeps the replicas equal
        return (
            algorithm is not None
            and not algorithm.delayed
            and (inner_steps - warmup) % policy.sync_every == 0
        )

    def finish(self) -> None:
        """After the run's last step: a streaming fragment's mean still in flight is applied now, so that
        the last checkpoint, the evaluation and the model fit returns hold it (summary.json's
        final_merge_applied says whether there was one)."""
        applied = bool(self.handle.flush_sync())  # live mode may reach the last step twice (a rollback)
        self.final_merge_applied = self.final_merge_applied or applied

    def rebind(self, handle: Any) -> None:
        """Live mode: the replica was rebuilt on a new group; the outer state lives in the new handle."""
        self.handle = handle
        if self.outer is not None:
            self.outer.handle = handle
        if isinstance(self.workers, ShardedWorkers):
            self.workers.handle = handle

    def summary(self, faults: list[dict[str, Any]]) -> dict[str, Any]:
        """summary.json's entries of a low-communication run: a digest of the outer state (anchors, outer
        momentum, a mean in flight: the same bits on every rank), and in live mode the samples whose
        contribution a lost member took with it (streaming DiLoCo: the faults' `dropped`). A sharded run's
        outer state is each rank's shard: its digest is rank 0's shard's (the same as the other groups' first
        ranks' at a round's end), computed without a collective as the replicated one is."""
        outer = self.handle.sync_state_dict()
        digest = state_sha256({key: outer[key] for key in ("inner_steps", "anchor", "outer", "pending")})
        dropped = sum(int(fault.get("dropped", {}).get("samples", 0)) for fault in faults)
        return {
            "outer_sha256": digest,
            "samples_dropped": dropped,
            "final_merge_applied": self.final_merge_applied,
        }

    def before_save(self) -> None:
        """On every rank: every rank's own state, to rank 0 (the replicas differ mid-round); nothing for a
        sharded run, whose every rank writes its own."""
        if isinstance(self.workers, WorkerStates):
            self.workers.collect()


class WorkerStates:
    """The `workers` entry of a checkpoint: each rank's model and optimizer state, by rank.

    At another world size it resumes only from a round's end (`at_round_end()` true when it was saved),
    where every replica is equal: new rank r takes saved rank r mod W's state (its own inner optimizer
    state while r < W; a copy of a peer's beyond, as a live-mode replacement does).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        group: Any = None,
        at_round_end: Callable[[], bool] = lambda: False,
    ) -> None:
        self.module, self.optimizer, self.group = module, optimizer, group
        self.at_round_end = at_round_end
        self._gathered: list[dict[str, Any]] | None = None
        self._round_end = False

    def collect(self) -> None:
        """On every rank, before a save: gather every rank's state to rank 0."""
        mine = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        tensors = list(_tensors(mine))
        received: list[list[torch.Tensor]] = [[] for _ in range(world)]
        device = comm_device(self.group)
        for t in tensors:
            src = t.detach().contiguous()
            if device.type != "cpu" and src.device != device:
                # NCCL takes tensors on its device only, and a CUDA model's state holds CPU tensors too
                # (Adam's step counts); gloo takes both where they are
                src = src.to(device)
            parts = [torch.empty_like(src) for _ in range(world)] if rank == 0 else None
            with tracked("gather (worker state for a checkpoint)", [src], self.group):
                dist.gather(
                    src, parts, dst=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
                )
            if parts is not None:
                for r, part in enumerate(parts):
                    received[r].append(part.to(t.device))  # where this rank keeps it (no copy if there)
        self._gathered = [_rebuild(mine, iter(parts)) for parts in received] if rank == 0 else None
        self._round_end = self.at_round_end()

    def state_dict(self) -> dict[str, Any]:
        """Rank 0 after collect(): every rank's state. Otherwise (a load compares against it) no rank's."""
        ranks = self._gathered or []
        return {"world_size": len(ranks), "ranks": ranks, "round_end": self._round_end}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        saved_world = int(state["world_size"])
        if not state["ranks"]:
            raise ConfigError("this checkpoint was saved without its workers' states (collect() did not run)")
        if saved_world != world and not state.get("round_end", False):
            raise ConfigError(
                f"[rank {rank}/{world}] this checkpoint of a low-communication run (sync) was taken in the middle "
                f"of a round: its {saved_world} workers each hold their own parameters and inner optimizer; it "
                f"resumes exactly with {saved_world} processes only, not {world}: relaunch with -n {saved_world}, "
                "or resume from a checkpoint at a round's end (a step after an outer sync: a multiple of "
                "sync_every, for local_sgd and diloco)"
            )
        mine = state["ranks"][rank % saved_world]  # at a round's end the parameters are equal on all
        with torch.no_grad():
            self.module.load_state_dict(mine["model"])
        self.optimizer.load_state_dict(mine["optimizer"])


class ShardedWorkers:
    """The `workers` entry of a sharded periodic run's checkpoint, held rank by rank (a RankStateful:
    checkpoint/rank_part.py): this rank's local shards of the model, its inner optimizer's state on them and
    its outer sync state (inner steps, anchors, outer momentum, means in flight), written by this rank and
    read back by it. It overrides what the checkpoint's sharded `model` and `optimizer` entries load, which
    DCP wrote from replica group 0 only (a shard several ranks hold is written by the lowest of them).

    Mid-round the replica groups differ, and inside a group every rank holds other rows; the outer state is
    kept on local shards, which another layout would cut otherwise: it loads at the world size and shard
    degree it was saved at only (`layout_refusal` says how to resume).
    """

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, handle: Any, *, wait: bool = True
    ) -> None:
        self.module, self.optimizer, self.handle = module, optimizer, handle
        self.wait = wait  # wait for a streaming mean in flight (False: save this rank's contribution)

    def rank_layout(self) -> dict[str, Any]:
        return {"world_size": int(self.handle.world), "shard_degree": int(self.handle.layout.shard_degree)}

    def layout_refusal(self, saved: dict[str, Any]) -> str:
        world, degree = saved.get("world_size"), saved.get("shard_degree")
        here = self.rank_layout()
        return (
            f"this checkpoint of a sharded periodic run was saved on {world} ranks in groups of {degree} "
            f"(each rank's own shards, inner optimizer and outer state, mid-round); this run has "
            f"{here['world_size']} ranks in groups of {here['shard_degree']}: resume with -n {world} "
            f"--shard-degree {degree}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {name: t.detach().clone() for name, t in _local_values(self.module).items()},
            "optimizer": _local_optimizer_state(self.optimizer),
            "outer": dict(self.handle.sync_state_dict(wait=self.wait)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"model", "optimizer", "outer"} - set(state)
        if missing:
            raise ConfigError(
                f"this `workers` state lacks {sorted(missing)}: it is not a sharded periodic run's (a replicated "
                "periodic run's checkpoint does not resume a sharded one); resume with the settings it was saved with"
            )
        _load_local_values(self.module, state["model"])
        self.optimizer.load_state_dict(_sharded_optimizer_state(self.optimizer, state["optimizer"]))
        self.handle.load_sync_state_dict(state["outer"])


def _local_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's and buffer's values that this rank holds (a DTensor's local shard: a view of its
    storage, so that writing into it changes the parameter), by name."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: local_shard(t) for name, t in named}


def _load_local_values(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy this rank's saved values into its local shards, after checking that every name and shape fits."""
    mine = _local_values(module)
    wrong = sorted(set(mine) ^ set(saved)) + [
        f"{name} {list(saved[name].shape)} vs {list(t.shape)}"
        for name, t in mine.items()
        if name in saved and saved[name].shape != t.shape
    ]
    if wrong:
        raise ConfigError(
            f"this rank's saved shards do not fit its model ({', '.join(wrong[:8])}): load a checkpoint of this "
            "model, at the layout it was saved at"
        )
    with torch.no_grad():
        for name, t in mine.items():
            t.copy_(saved[name])


def _local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict() with every DTensor replaced by this rank's local values (a copy); "dtensors"
    names the (parameter index, key) of each, to be made DTensors again on load."""
    saved = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    dtensors: list[list[Any]] = []
    for index, values in saved["state"].items():
        state[index] = {}
        for key, value in values.items():
            if isinstance(value, DTensor):
                dtensors.append([index, key])
                value = value.to_local()
            state[index][key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return {"state": state, "param_groups": saved["param_groups"], "dtensors": dtensors}


def _sharded_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """What _local_optimizer_state() gave, with its local values made DTensors again on their parameters'
    mesh and placements (the optimizer steps DTensor parameters with DTensor state)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: dict(values) for index, values in saved["state"].items()}
    for index, key in saved["dtensors"]:
        param = params[int(index)]
        if not isinstance(param, DTensor):
            raise ConfigError(
                f"the optimizer's saved state {key!r} of parameter {index} is a shard, but the parameter is not "
                "sharded here: load at the layout the checkpoint was saved at"
            )
        state[index][key] = DTensor.from_local(
            state[index][key],
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return {"state": state, "param_groups": saved["param_groups"]}


class OuterState:
    """The `outer` entry of a checkpoint: the replica handle's outer sync state."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def state_dict(self) -> dict[str, Any]:
        return dict(self.handle.sync_state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.handle.load_sync_state_dict(state)


def _tensors(tree: Any) -> Any:
    """The tensors of a nested state, in a fixed order (dicts by key order, lists in order)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def _rebuild(tree: Any, parts: Any) -> Any:
    """`tree` with each tensor replaced by the next of `parts` (the same order as _tensors)."""
    if isinstance(tree, torch.Tensor):
        return next(parts)
    if isinstance(tree, dict):
        return {key: _rebuild(value, parts) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_rebuild(value, parts) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_rebuild(value, parts) for value in tree)
    return tree
