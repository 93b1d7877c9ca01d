"""`shard(module, policy)`: the model cut into shards with torch's FSDP2, with lockstep's guarantees on top.

lockstep shards with torch's own FSDP2 (`torch.distributed.fsdp.fully_shard` on a DeviceMesh): no
home-made ZeRO-3. The world is cut into replica groups of `shard_degree` ranks (consecutive ranks, so a
shard group stays inside a node where it can): each group holds one copy of the model in shards (FSDP),
and the groups average their shards' gradients (HSDP). shard_degree = world is FSDP (ZeRO-3). What
lockstep adds (ShardHandle):

- `accumulate()`, the step of K micro-batches of deterministic mode (engine/deterministic/micro_step.py)
  with FSDP2's reduce-scatter made an exact sum (exact_scatter.py): the same bits as a replicated run at
  any layout. FSDP2's own HSDP all-reduce is a plain float sum with no slot for another, so in this mode
  FSDP2 shards over the shard group alone (a 1-D mesh) and the cross-group sum is lockstep's;
- `clip_grad_norm_()`, exact in deterministic mode (engine/deterministic/exact_norm.py);
- FSDP2's all-gathers and reduce-scatters numbered for the hang watchdog (comms.py);
- the units chosen by a policy that never splits tied parameters (units.py);
- `full_state_dict()`, the replicated state's names and values (summary hashes, comparisons);
- a periodic sync across the replica groups (ShardPolicy.sync: local SGD, DiLoCo, streaming DiLoCo):
  FSDP2 shards and reduce-scatters inside each group (a 1-D mesh), each group steps on its own, and every
  H steps the ranks that hold the same shard in each group meet on it (engine/periodic/outer_sync.py on the
  local shards, over the replicate group): the bytes between groups are the outer sync's alone.

The bytes a handle sent are counted apart: inside the shard groups (`bytes_in_group`) and between the
replica groups (`bytes_communicated_total`, summary.json's comm_bytes: HSDP's all-reduces, deterministic
mode's cross-group sums, or the periodic sync's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lockstep.engine.core.init_sync import broadcast_coalesced, check_same_model
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.core.stats import EngineStats
from lockstep.engine.deterministic.micro_step import MicroSteps
from lockstep.engine.sharded.comms import CommBytes, CountAllReduce, TrackedAllGather, TrackedReduceScatter
from lockstep.engine.sharded.exact_scatter import ExactReduceScatter, ShardedExactReducer
from lockstep.engine.sharded.group_sync import GroupSync, check_periodic
from lockstep.engine.sharded.step_marks import StepMarks
from lockstep.engine.sharded.sums import ExactSums, FloatSums
from lockstep.engine.sharded.units import UnitRule, check_shardable, choose_units
from lockstep.errors import ConfigError, NotSupportedError, rank_tag
from lockstep.plan import check_shard_layout
from lockstep.torch_private import fsdp_unit_params


@dataclass(frozen=True)
class ShardPolicy:
    """How `shard()` cuts a model.

    shard_degree: ranks that share one copy of the model (None: the whole world, FSDP; fewer: HSDP, the
        world / shard_degree replica groups averaging their shards' gradients). It must divide the world.
    reshard_after_forward: free each unit's gathered parameters after its forward (True, ZeRO-3) or keep
        them until its backward (False: ZeRO-2-like, one all-gather less per unit and step, more memory).
    deterministic: accumulate() sums exactly: the same bits as a replicated run at any layout.
    units: which submodules are FSDP units: None (each repeated block, else by size: units.py), a set
        of module classes, or a predicate.
    sync: the replica groups meet every `sync_every` steps instead of every step: a SyncPolicy whose `sync`
        is local_sgd, diloco or streaming_diloco (its periodic knobs; None or "allreduce": every step).
        Call `after_optimizer_step()` after each optimizer step. It needs 2 or more replica groups.
    """

    @property
    def periodic(self) -> bool:
        return self.sync is not None and self.sync.periodic

    shard_degree: int | None = None
    reshard_after_forward: bool = True
    deterministic: bool = False
    units: UnitRule | Iterable[type[nn.Module]] | None = None
    sync: SyncPolicy | None = None


@dataclass(frozen=True)
class ShardLayout:
    """The meshes of a sharded run: FSDP2's, and the groups of the exact sums."""

    mesh: DeviceMesh  # what fully_shard gets (1-D, or 2-D (replicate, shard) for FSDP2's HSDP)
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None  # None when the whole world is one shard group
    shard_degree: int
    replicas: int


def shard_layout(shard_degree: int, *, device_type: str, deterministic: bool, tag: str = "") -> ShardLayout:
    """The world cut into world / shard_degree replica groups of shard_degree consecutive ranks.
    `deterministic`: FSDP2 shards over the shard group alone (a 1-D mesh), and what crosses the groups is
    lockstep's (deterministic mode's exact sums, or a periodic sync). `tag` ends the mesh's dimension
    names: a layout made on a new world after another (rebuild.py) must not equal an older mesh, since
    torch compares meshes without their groups, and DTensor's caches would hand back the older one."""
    world = dist.get_world_size()
    replicas = world // shard_degree
    shard, replicate = f"shard{tag}", f"replicate{tag}"
    if replicas == 1:
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=(shard,))
        return ShardLayout(mesh, mesh.get_group(), None, shard_degree, 1)
    grid = init_device_mesh(device_type, (replicas, shard_degree), mesh_dim_names=(replicate, shard))
    shard_mesh = grid[shard]
    mesh = shard_mesh if deterministic else grid
    return ShardLayout(mesh, shard_mesh.get_group(), grid[replicate].get_group(), shard_degree, replicas)


def shard(module: nn.Module, policy: ShardPolicy = ShardPolicy()) -> ShardHandle:
    """Shard `module` in place over the default process group with torch's FSDP2 (see the module doc).

    Every rank calls it with the same model. Afterwards the module's parameters are DTensors: build the
    optimizer on `module.parameters()` after this call.

    Raises:
        ConfigError: no process group, a shard degree that does not divide the world, a unit the policy
            chose that would split tied parameters, a parameter FSDP2 cannot shard (each named), a
            periodic sync with one replica group.
        NotSupportedError: a periodic sync in deterministic mode or with a warm-up.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("shard() needs an initialized process group (lockstep.init_process_group())")
    world = dist.get_world_size()
    degree = policy.shard_degree or world
    check_shard_layout(world, degree)
    if policy.deterministic and degree < 2:  # FSDP2 calls no reduce-scatter on a shard group of one
        raise ConfigError(
            f"deterministic sharding needs a shard group of 2 or more ranks, got shard_degree {degree} at world "
            f"{world}: use lockstep.replicate(module, policy=SyncPolicy(deterministic=True)) for a replicated model"
        )
    if policy.periodic:
        check_periodic(policy.sync, deterministic=policy.deterministic, world=world, degree=degree)
    check_shardable(module)
    agree_on_the_model(module, world)
    device_type = next((p.device.type for p in module.parameters()), "cpu")
    units = choose_units(module, policy.units)
    own_cross_sums = policy.deterministic or policy.periodic
    layout = shard_layout(degree, device_type=device_type, deterministic=own_cross_sums)
    for unit in units:
        fully_shard(unit, mesh=layout.mesh, reshard_after_forward=policy.reshard_after_forward)
    fully_shard(module, mesh=layout.mesh, reshard_after_forward=policy.reshard_after_forward)
    return ShardHandle(module, units, layout, policy)


def agree_on_the_model(module: nn.Module, world: int) -> None:
    """Every rank holds the same model, then rank 0's values, as the replicated engine starts (FSDP2 cuts each
    rank's shard from its own copy: copies made with other seeds would be spliced into one silent mix)."""
    if world == 1:
        return
    check_same_model(list(module.named_parameters()), None, dist.get_rank(), world)
    broadcast_coalesced([*module.parameters(), *module.buffers()], 0, None)


class ShardHandle:
    """A model sharded by `shard()`: its steps, clipping, statistics and full state."""

    def __init__(
        self, module: nn.Module, units: list[nn.Module], layout: ShardLayout, policy: ShardPolicy
    ) -> None:
        self.module, self.layout, self.policy = module, layout, policy
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tag = rank_tag(self.rank, self.world)
        self._fsdp: list[FSDPModule] = [*(u for u in units if isinstance(u, FSDPModule))]
        if isinstance(module, FSDPModule):
            self._fsdp.append(module)
        self.sent = CommBytes()
        self.carried = (0, 0, 0, 0)  # a model rebuilt on a new world: bytes between, in group, steps, redos
        self._track_comms(reduce_scatter=not policy.deterministic)
        # a periodic sync: the groups meet on their local shards, over the ranks holding the same one
        self.group_sync = (
            GroupSync(module, policy.sync, layout.shard_group, layout.replicate_group, layout.replicas)
            if policy.periodic and policy.sync is not None
            else None
        )
        # how the gradients are summed, chosen once: lockstep's exact sums or FSDP2's own
        self.sums: ExactSums | FloatSums = (
            ExactSums(self._exact_sums()) if policy.deterministic else FloatSums(self)
        )
        self.micro_steps = MicroSteps(module, None, rank=self.rank, world=self.world)
        # deterministic mode replays BatchNorm's running buffers itself (micro_step.RunningStats); a periodic
        # sync's groups keep their own (averaged at each round's end), each from its first rank
        self._hooks = StepMarks(
            module,
            sync_buffers=not policy.deterministic,
            group=layout.shard_group if policy.periodic else None,
        )

    def _exact_sums(self) -> ShardedExactReducer:
        owned = [(m, [p for p in fsdp_unit_params(m) if p.requires_grad]) for m in self._fsdp]
        owned = [(m, params) for m, params in owned if params]
        device = next(p.device for _, params in owned for p in params)
        reducer = ShardedExactReducer(
            [params for _, params in owned],
            shard_group=self.layout.shard_group,
            replicate_group=self.layout.replicate_group,
            device=device,
        )
        for unit, (m, _) in enumerate(owned):
            m.set_custom_reduce_scatter(ExactReduceScatter(reducer, unit))
            m.set_reduce_scatter_unused_params(True, recurse=False)
            # no division before the comm: FSDP2 pre-divides a float64 or float16 input by a factor of
            # the group's size otherwise, and the exact sum would then be that much off
            m.set_gradient_divide_factor(1.0)
        return reducer

    def _track_comms(self, *, reduce_scatter: bool) -> None:
        """FSDP2's all-gathers (and, outside deterministic mode, its reduce-scatters) numbered and counted."""
        names = {id(m): name or "(root)" for name, m in self.module.named_modules()}
        for m in self._fsdp:
            if fsdp_unit_params(m):
                name = names.get(id(m), type(m).__name__)
                m.set_custom_all_gather(TrackedAllGather(name, self.sent))
                if reduce_scatter:
                    m.set_custom_reduce_scatter(TrackedReduceScatter(name, self.sent))
                if self.layout.mesh.ndim == 2:  # FSDP2's HSDP: its all-reduce across the groups, counted
                    m.set_all_reduce_hook(CountAllReduce(self.sent))

    # ---- steps -------------------------------------------------------------------------------------------

    def owned_micro_batches(self, num_micro_batches: int) -> list[int]:
        """The ordinals of a step's K micro-batches that this rank computes in accumulate()."""
        return self.micro_steps.owned(num_micro_batches)

    def accumulate(
        self,
        fn: Callable[[Any], Any],
        micro_batches: Mapping[int, Any],
        *,
        num_micro_batches: int,
        step: int,
        seed: int = 0,
    ) -> dict[int, Any]:
        """One step of K micro-batches over the ranks, as ReplicaHandle.accumulate(): afterwards the sharded
        `.grad`s hold their mean (exact with ShardPolicy(deterministic=True)). Every rank computes the same
        number of micro-batches (K a multiple of the world size): each micro-batch's forward all-gathers on
        every rank of the shard group, and in deterministic mode its backward reduce-scatters."""
        if num_micro_batches % self.world:
            raise ConfigError(
                f"{self.tag}accumulate() on a sharded model with {num_micro_batches} micro-batches on "
                f"{self.world} ranks: every rank must compute the same number (each micro-batch's "
                "reduce-scatter needs every rank of the shard group); use a multiple of the world size"
            )
        return self.micro_steps.run(
            self.sums.reduction, fn, micro_batches, num_micro_batches=num_micro_batches, step=step, seed=seed
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside keep their (unsharded) gradients; the next backward outside reduce-scatters the
        sum (FSDP2's set_requires_gradient_sync, as torch's DDP's no_sync)."""
        root = self._fsdp[-1]
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to `max_norm`; exact in deterministic mode (the same norm at any layout)."""
        return self.sums.clip(self.module.parameters(), max_norm)

    def remove(self) -> None:
        """FSDP2 changes the module's class and parameters in place, with no way back.

        Raises:
            NotSupportedError: always; build the model anew to train it unsharded.
        """
        raise NotSupportedError(
            f"{self.tag}a model sharded by FSDP2 cannot be made plain again in place: build it anew (and "
            "load a checkpoint) to train it replicated"
        )

    # ---- a periodic sync across the replica groups (ShardPolicy.sync) --------------------------------------

    @property
    def sync_policy(self) -> SyncPolicy | None:
        """The periodic sync's policy (None: the groups average every step)."""
        return self.policy.sync if self.group_sync is not None else None

    def after_optimizer_step(self) -> bool:
        """A periodic sync: call after each optimizer step (every rank). Counts the step and, every
        sync_every steps, the groups meet on their shards. True when this call synced (a fragment).

        Raises:
            NotSupportedError: the groups average every step (no ShardPolicy.sync).
        """
        return self._periodic("after_optimizer_step()").after_optimizer_step()

    def before_optimizer_step(self) -> bool:
        """A periodic sync: nothing before the step (a sharded run has no warm-up of its own); False."""
        self._periodic("before_optimizer_step()")
        return False

    def flush_sync(self) -> bool:
        """A periodic sync at the end of training: apply the streaming fragments still in flight."""
        return self._periodic("flush_sync()").flush()

    def sync_state_dict(self, *, wait: bool = True) -> dict[str, Any]:
        """The outer state a resume needs: the steps counted, and this rank's shard of the anchor and of the
        outer momentum (the same in every replica group; it differs between the ranks of a group)."""
        return self._periodic("sync_state_dict()").outer.state_dict(wait=wait)

    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what sync_state_dict() returned on this rank (the same shard layout)."""
        self._periodic("load_sync_state_dict()").outer.load_state_dict(state)

    def _periodic(self, what: str) -> GroupSync:
        if self.group_sync is None:
            raise NotSupportedError(
                f"{self.tag}{what} belongs to a periodic sync across replica groups; this sharded model's "
                "groups average every step: shard with ShardPolicy(sync=SyncPolicy(sync='diloco', ...))"
            )
        return self.group_sync

    def broadcast_buffers_for_step(self) -> None:
        """Nothing here: every forward with gradients takes rank 0's buffers (StepMarks), as torch's DDP (a
        periodic sync's groups: their first rank's)."""

    # ---- what it holds -----------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Any]:
        """The module's state dict with every DTensor gathered to its full value (a collective)."""
        return full_tensors(self.module.state_dict())

    def stats(self) -> EngineStats:
        """The shard layout and the bytes FSDP2's collectives (or deterministic mode's sums) sent."""
        between = self.carried[0] + self.sent.between + self.sums.bytes_between()
        outer = self.group_sync.outer if self.group_sync is not None else None
        extras: dict[str, Any] = {}
        if outer is not None:
            between += outer.bytes_sent
            extras = {
                "sync": outer.settings.sync,
                "inner_steps": outer.inner_steps,
                "outer_syncs": outer.outer_syncs,
                "warmup_steps": outer.warmup_steps,
                "fragments": [len(f) for f in outer.fragments],
            }
        return EngineStats(
            world_size=self.world,
            num_parameters=sum(1 for _ in self.module.parameters()),
            num_buckets=len(self._fsdp),
            bucket_sizes_bytes=[],
            bucket_num_params=[len(fsdp_unit_params(m)) for m in self._fsdp],
            buckets_rebuilt=False,
            synced_steps=self.carried[2] + self.micro_steps.steps,
            last=None,
            mean=None,
            extras={
                "bytes_communicated_total": between,  # between the replica groups
                "bytes_in_group": self.carried[1] + self.sent.total + self.sums.bytes_sent(),
                "shard_degree": self.layout.shard_degree,
                "replica_groups": self.layout.replicas,
                "steps_redone": self.carried[3] + self.sums.redos(),
                **extras,
            },
        )


def is_sharded(module: nn.Module) -> bool:
    """Whether `module`'s parameters are DTensors (a model `shard()` or torch's fully_shard cut)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def full_tensors(state: Any) -> Any:
    """`state` with every DTensor replaced by its full value (a collective on the DTensor's mesh): dicts
    and lists are walked, other values kept."""
    if isinstance(state, DTensor):
        return state.full_tensor()
    if isinstance(state, dict):
        return {key: full_tensors(value) for key, value in state.items()}
    if isinstance(state, list):
        return [full_tensors(value) for value in state]
    return state
