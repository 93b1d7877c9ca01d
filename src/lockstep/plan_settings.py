"""A run's settings as the plan reads them (`RunSettings`), and the checks on their values that no pair of
switches states (lockstep/plan.py asks them at every door): a deterministic run's global batch, live
mode's micro-batches per rank, the shard layout (a whole number of shard groups of the run's ranks), a
sharded deterministic step's micro-batches, and a periodic sync across sharded replica groups (two groups
or more, no deterministic mode). Standard library only, as plan.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from lockstep.plan_table import ENGINE_KNOBS, SETTINGS, SYNC_KEYS


@dataclass(frozen=True)
class RunSettings:
    """The facts the plan decides from: a run's settings (FitConfig's names) and its launch.

    `sync` None and `batch_size` None say that the door does not know them: RunSettings() has no key of the
    table, and the engine's doors (SyncPolicy), which cut no batch, skip the batch checks (VALUE_CHECKS).
    Every door that has a sync mode (fit, `lockstep train`, SyncPolicy) passes it, "allreduce" included."""

    deterministic: bool = False
    live: bool = False
    overlap_optimizer: bool = False
    shard_optimizer: bool = False
    shard_degree: int = 1  # ranks that share one copy of the model in shards (FSDP; HSDP over the groups)
    sync: str | None = None
    sync_dtype: str = "fp32"
    sync_warmup: int = 0
    fragments: int = 1
    fragment_delay: int = 1
    bucket_cap_mb: float | str | None = None
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    max_restarts: int = 0
    batch_size: int | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    world_size: int = 1  # launched ranks (live mode's launched world, whatever the survivors)
    min_world: int = 0  # live mode's --min-world (0: not given, or not live)
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    torch_bucket_layout: bool = False
    reduce_dtype: object = None  # a torch.dtype (this module does not import torch)
    live_loop: bool = False

    @classmethod
    def of(
        cls, config: object, *, world_size: int, live: bool = False, max_restarts: int = 0, min_world: int = 0
    ) -> RunSettings:
        """From any object with FitConfig's field names (FitConfig itself, a job's config)."""
        launch = {"live", "max_restarts", "world_size", "min_world"}
        names = {f.name for f in dataclasses.fields(cls)} - launch
        values = {name: getattr(config, name) for name in names if hasattr(config, name)}
        return cls(**values, live=live, max_restarts=max_restarts, world_size=world_size, min_world=min_world)

    def keys(self) -> list[str]:
        """The table's keys of the settings that are on, in the table's order."""
        cap = self.bucket_cap_mb
        on = {
            "deterministic": self.deterministic,
            "live": self.live,
            "overlap_optimizer": self.overlap_optimizer,
            "shard_optimizer": self.shard_optimizer,
            "shard_degree": self.shard_degree > 1,
            f"sync={self.sync}": self.sync is not None,  # "sync=allreduce" too, where the door says it
            f"sync_dtype={self.sync_dtype}": True,  # the casts (fp32, bf16, fp16) are no keys of the table
            "sync_warmup": self.sync_warmup > 0,
            "fragments": self.fragments > 1,
            "fragment_delay": self.fragment_delay != 1,
            "bucket_cap_mb=auto": isinstance(cap, str),
            "bucket_cap_mb": cap is not None and not isinstance(cap, str),
            "grad_accum_steps": self.grad_accum_steps > 1,
            "clip_grad_norm": self.clip_grad_norm is not None,
            f"precision={self.precision}": True,  # "precision=fp32" is none either
            "max_restarts": self.max_restarts > 0,
            **{knob: bool(getattr(self, knob)) for knob in ENGINE_KNOBS[:-1]},
            "reduce_dtype": self.reduce_dtype is not None,
            "live_loop": self.live_loop,
        }
        return [s.key for s in SETTINGS if on.get(s.key)]

    def live_cut(self) -> tuple[int, int, int] | None:
        """Live mode's cut of a step without deterministic mode (trainer/run/batches.py, plan_batches): the
        global batch (default: the per-rank batch on every launched rank), the micro-batch size (default:
        batch_size) and the micro-batches of a step; None where the door cuts no batch."""
        if self.batch_size is None:
            return None
        total = self.global_batch_size or self.batch_size * self.grad_accum_steps * self.world_size
        micro = self.micro_batch_size or min(self.batch_size, total)
        return total, micro, total // micro

    def facts(self) -> dict[str, object]:
        """The fields, and the values the plan computes from them (what the lines are formatted with)."""
        cut = self.live_cut() or (0, 0, 0)
        world = max(self.world_size, 1)
        rounded = -(-cut[2] // world) * world  # the step's micro-batches, up to a multiple of the ranks
        survivable = survivable_multiple(world, max(self.shard_degree, 1), self.min_world)
        return {
            **dataclasses.asdict(self),
            "step_samples": cut[0],
            "step_micro_batch_size": cut[1],
            "step_micro_batches": cut[2],
            "world_divisors": ", ".join(str(d) for d in range(1, world + 1) if world % d == 0),
            "even_step_samples": rounded * cut[1],
            "group_degree": max((d for d in range(1, world) if world % d == 0), default=1),  # 2+ groups
            "survivable_multiple": survivable,
            "even_live_samples": -(-cut[2] // survivable) * survivable * cut[1],
        }


@dataclass(frozen=True)
class ValueCheck:
    """A check on values that no pair of switches states: the setting `key` is refused where `refuses` holds.
    `flag` and `python` spell the case (formatted with RunSettings.facts()), as the command line and as
    Python write it; so does `instead`."""

    key: str
    flag: str
    python: str
    reason: str
    instead_flag: str
    instead_python: str
    refuses: Callable[[RunSettings], bool]
    short: str  # the case in a few words, after "refused" in `lockstep train --help`

    def line(self, settings: RunSettings | None, *, flags: bool) -> str:
        values = PLACEHOLDER_FACTS if settings is None else settings.facts()
        case = (self.flag if flags else self.python).format(**values)
        instead = (self.instead_flag if flags else self.instead_python).format(**values)
        return f"{case}: {self.reason}; {instead}"


def _needs_a_global_batch(s: RunSettings) -> bool:
    return s.batch_size is not None and s.deterministic and s.global_batch_size is None


def _too_few_micro_batches(s: RunSettings) -> bool:
    cut = s.live_cut()
    return s.live and not s.deterministic and cut is not None and cut[2] < s.world_size


def _shards_beyond_the_world(s: RunSettings) -> bool:
    return s.shard_degree > s.world_size


def _shards_not_dividing_the_world(s: RunSettings) -> bool:
    return s.shard_degree <= s.world_size and s.world_size % s.shard_degree != 0


def _uneven_sharded_micro_batches(s: RunSettings) -> bool:
    # deterministic mode cuts the step's global batch into micro-batches over all ranks; sharded, every rank
    # joins each micro-batch's reduce-scatter, so every rank must compute as many as the others
    cut = s.live_cut()
    sharded = s.shard_degree > 1 and s.deterministic and s.global_batch_size is not None
    return sharded and cut is not None and cut[2] % s.world_size != 0


def survivable_multiple(world: int, degree: int, min_world: int = 0) -> int:
    """The least count of micro-batches that every world live mode can shrink a sharded run to divides:
    the replica groups leave whole, so the worlds are the multiples of degree from --min-world (rounded up;
    one group when not given) to world."""
    lowest = max(1, -(-min_world // degree))  # groups
    return degree * math.lcm(*range(lowest, world // degree + 1))


def _live_shards_uneven_after_a_loss(s: RunSettings) -> bool:
    # a lost step is redone over the groups left, and every rank computes as many micro-batches as the others
    cut = s.live_cut() if s.global_batch_size is not None or not s.deterministic else None
    if not (s.live and s.shard_degree > 1 and cut is not None) or s.world_size % s.shard_degree:
        return False
    return cut[2] % survivable_multiple(s.world_size, s.shard_degree, s.min_world) != 0


def _live_sharded_rounds(s: RunSettings) -> bool:
    return s.live and s.shard_degree > 1 and _periodic(s)


def _periodic(s: RunSettings) -> bool:
    return f"sync={s.sync}" in SYNC_KEYS


def _one_group_to_meet(s: RunSettings) -> bool:
    # a periodic sync meets the other replica groups; FSDP over the whole world is one group
    return _periodic(s) and 1 < s.shard_degree == s.world_size


def _exact_inner_steps_of_shards(s: RunSettings) -> bool:
    return _periodic(s) and s.shard_degree > 1 and s.deterministic


# The shard layout's checks: every door makes them, and the engine's own (check_shard_layout) too.
SHARD_LAYOUT_CHECKS: tuple[ValueCheck, ...] = (
    ValueCheck(
        "shard_degree",
        "--shard-degree {shard_degree} is larger than the world size {world_size} (-n {world_size})",
        "shard_degree={shard_degree} is larger than the world size {world_size}",
        "a shard group is made of the run's ranks",
        "use a divisor of {world_size} ({world_divisors}), or launch more ranks",
        "use a divisor of {world_size} ({world_divisors}), or launch more ranks",
        _shards_beyond_the_world,
        "larger than the world size (-n)",
    ),
    ValueCheck(
        "shard_degree",
        "--shard-degree {shard_degree} does not divide the world size {world_size} (-n {world_size})",
        "shard_degree={shard_degree} does not divide the world size {world_size}",
        "the world must be a whole number of shard groups",
        "use a divisor of {world_size} ({world_divisors})",
        "use a divisor of {world_size} ({world_divisors})",
        _shards_not_dividing_the_world,
        "where it does not divide the world size (-n)",
    ),
)


VALUE_CHECKS: tuple[ValueCheck, ...] = (
    ValueCheck(
        "deterministic",
        "--deterministic without --global-batch-size",
        "deterministic=True without global_batch_size",
        "the same bits at any world size need a global batch that does not depend on it (one made up from "
        "the ranks of this launch would change at a resume on another number of ranks)",
        "pass one, e.g. --global-batch-size 64 --micro-batch-size 8",
        "set one, e.g. FitConfig(deterministic=True, global_batch_size=64, micro_batch_size=8)",
        _needs_a_global_batch,
        "without --global-batch-size",
    ),
    ValueCheck(
        "live",
        "--min-world without --deterministic on {world_size} ranks, {step_micro_batches} micro-batches of "
        "{step_micro_batch_size} in a step of {step_samples} samples",
        "live mode (--min-world) without deterministic=True on {world_size} ranks, {step_micro_batches} "
        "micro-batches of {step_micro_batch_size} in a step of {step_samples} samples",
        "live mode cuts each step into micro-batches, and every launched rank needs one (fewer than the ranks)",
        "lower --micro-batch-size, raise --global-batch-size, or add --deterministic",
        "lower micro_batch_size, raise global_batch_size, or use deterministic=True",
        _too_few_micro_batches,
        "without --deterministic where a step has fewer micro-batches than ranks",
    ),
    *SHARD_LAYOUT_CHECKS,
    ValueCheck(
        "shard_degree",
        "--shard-degree {shard_degree} with --sync {sync} on {world_size} ranks",
        "shard_degree={shard_degree} with sync={sync!r} on {world_size} ranks",
        "a periodic sync is one of replica groups meeting every few steps, and a shard degree of the whole "
        "world makes one group (FSDP), with no other to meet",
        "use a shard degree that makes two groups or more (HSDP), e.g. --shard-degree {group_degree}, or sync "
        "every step (--sync allreduce)",
        "use a shard degree that makes two groups or more (HSDP), e.g. shard_degree={group_degree}, or "
        "sync='allreduce'",
        _one_group_to_meet,
        "where a periodic --sync has one group (the whole world) to meet",
    ),
    ValueCheck(
        "shard_degree",
        "--shard-degree {shard_degree} with --sync {sync} and --deterministic",
        "shard_degree={shard_degree} with sync={sync!r} and deterministic=True",
        "deterministic mode's exact sums are not built for the inner steps of a sharded periodic sync (each "
        "group's own micro-batches)",
        "leave --deterministic off (the groups' sums are FSDP2's), or sync every step (--sync allreduce)",
        "leave deterministic off (the groups' sums are FSDP2's), or sync='allreduce'",
        _exact_inner_steps_of_shards,
        "in deterministic mode under a periodic --sync",
    ),
    ValueCheck(
        "shard_degree",
        "--shard-degree {shard_degree} and --deterministic on {world_size} ranks, {step_micro_batches} "
        "micro-batches of {step_micro_batch_size} in a step of {step_samples} samples",
        "shard_degree={shard_degree} and deterministic=True on {world_size} ranks, {step_micro_batches} "
        "micro-batches of {step_micro_batch_size} in a step of {step_samples} samples",
        "every rank joins every micro-batch's reduce-scatter, so every rank must compute as many micro-batches "
        "as the others: the step's micro-batches must be a multiple of the ranks",
        "make them a multiple of {world_size}, e.g. --global-batch-size {even_step_samples} --micro-batch-size "
        "{step_micro_batch_size}, or leave --shard-degree at 1",
        "make them a multiple of {world_size}, e.g. global_batch_size={even_step_samples}, micro_batch_size="
        "{step_micro_batch_size}, or leave shard_degree at 1",
        _uneven_sharded_micro_batches,
        "in deterministic mode where a step's micro-batches are not a multiple of the ranks",
    ),
    ValueCheck(
        "shard_degree",
        "--shard-degree {shard_degree} and --min-world on {world_size} ranks, {step_micro_batches} "
        "micro-batches of {step_micro_batch_size} in a step",
        "shard_degree={shard_degree} in live mode (--min-world) on {world_size} ranks, {step_micro_batches} "
        "micro-batches of {step_micro_batch_size} in a step",
        "live mode redoes a step lost with a replica group over the groups left, and every rank computes as "
        "many micro-batches as the others: a step's micro-batches must divide evenly over every world the "
        "groups can shrink to (whole groups, down to --min-world)",
        "make them a multiple of {survivable_multiple}, e.g. --global-batch-size {even_live_samples} "
        "--micro-batch-size {step_micro_batch_size}",
        "make them a multiple of {survivable_multiple}, e.g. global_batch_size={even_live_samples}, "
        "micro_batch_size={step_micro_batch_size}",
        _live_shards_uneven_after_a_loss,
        "in live mode where a step's micro-batches do not divide evenly over every world left",
    ),
    ValueCheck(
        "shard_degree",
        "--shard-degree {shard_degree} with --sync {sync} and --min-world",
        "shard_degree={shard_degree} with sync={sync!r} in live mode (--min-world)",
        "live recovery of a sharded periodic sync is not built: its rounds' marks hold replicated models",
        "run it without live mode (restarts resume it from its checkpoints), or sync every step (--sync "
        "allreduce)",
        "run it without live mode, or sync='allreduce'",
        _live_sharded_rounds,
        "in live mode under a periodic --sync",
    ),
)
PLACEHOLDER_FACTS = {
    "world_size": "N",
    "shard_degree": "S",
    "world_divisors": "1, ..., N",
    "even_step_samples": "G'",
    "step_micro_batches": "K",
    "step_micro_batch_size": "M",
    "step_samples": "G",
    "group_degree": "S'",
    "survivable_multiple": "L",
    "even_live_samples": "G'",
    "sync": "MODE",
}
