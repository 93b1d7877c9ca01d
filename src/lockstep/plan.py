"""The run's plan: which of a run's settings combine, decided once from one table, before any worker starts.

A run's modes come from a handful of settings (deterministic, live, the optimizer's overlap and sharding,
the sync mode and what it sends, its warm-up and fragments, the bucket size, accumulation, clipping,
precision, restarts, the engine's own knobs). Every pair of them either runs, falls back (one of the two
does not apply, and the run says why, once) or is refused (with what to do instead). That table is
plan_table.py's (`RULES`; a pair not in it runs; re-exported here); this module holds the plan built from
it for a run's settings (`RunSettings`, `Plan.of`) and the checks on values that no pair states
(`VALUE_CHECKS`: deterministic mode needs a global batch; float live mode needs a micro-batch of every step
per rank; shard_degree must divide the world size, and sharded deterministic mode needs the step's
micro-batches in a multiple of the ranks), and nothing else decides them. The engine's door, which has no
FitConfig, makes the shard layout's checks with `check_shard_layout(world_size, shard_degree)`. Each door
builds the plan once, from its own names, and hands it down:

- `lockstep train` (jobs/cli.py `plan_of`) builds it from the settings and the launch before starting a
  worker, so a refusal is one line and exit status 2, never a traceback per rank (`lockstep run` starts a
  program whose settings it does not know: the program's `fit` or SyncPolicy meets the refusal), and its
  --help says what each flag does not combine with from the same table (`flag_verdicts`);
- `lockstep.fit` (trainer/settings/config.py `plan_of`) builds it from its FitConfig and world;
- the native API: SyncPolicy builds it from its knobs (`SyncPolicy.plan`), and the replica's
  `overlap_optimizer` asks that plan, with the call's clipping and scaler added (or the plan fit passes);
  LiveLoop's own setting is `live_loop`.

The same setting gets the same verdict at every door (tests/unit/test_plan_doors.py sets every pair and
every value check through each).

docs/modes.md shows the table as `markdown_table()` writes it (a test keeps the two equal). Standard
library only: the launcher imports it without torch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from lockstep.errors import ConfigError
from lockstep.plan_table import (
    ENGINE_KNOBS,
    FRAGMENT_LAYOUTS,
    PYTHON_ONLY,
    QUANTIZED_SYNC_DTYPES,
    RULES,
    SETTINGS,
    SYNC_DTYPES,
    SYNC_KEYS,
    SYNC_MODES,
    UNFRAGMENTED_SYNC_KEYS,
    Reduction,
    Rule,
    Setting,
    Verdict,
    flag_of,
    rule_for,
)

# The table's names are re-exported: the doors read them from lockstep.plan.
__all__ = [
    "ENGINE_KNOBS",
    "FRAGMENT_LAYOUTS",
    "PYTHON_ONLY",
    "QUANTIZED_SYNC_DTYPES",
    "RULES",
    "SETTINGS",
    "SYNC_DTYPES",
    "SYNC_KEYS",
    "SYNC_MODES",
    "UNFRAGMENTED_SYNC_KEYS",
    "Reduction",
    "Rule",
    "Setting",
    "Verdict",
    "flag_of",
    "rule_for",
    "PlanRefused",
    "RunSettings",
    "ValueCheck",
    "VALUE_CHECKS",
    "Plan",
    "flag_verdicts",
    "markdown_table",
    "SHARD_LAYOUT_CHECKS",
    "check_shard_layout",
]


class PlanRefused(ConfigError):
    """Settings that do not combine: the message is one line naming them and what to do instead (`rule`: the
    table's pair, or the value check)."""

    def __init__(self, message: str, rule: Rule | ValueCheck) -> None:
        super().__init__(message)
        self.rule = rule


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
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    torch_bucket_layout: bool = False
    reduce_dtype: object = None  # a torch.dtype (this module does not import torch)
    live_loop: bool = False

    @classmethod
    def of(cls, config: object, *, world_size: int, live: bool = False, max_restarts: int = 0) -> RunSettings:
        """From any object with FitConfig's field names (FitConfig itself, a job's config)."""
        launch = {"live", "max_restarts", "world_size"}
        names = {f.name for f in dataclasses.fields(cls)} - launch
        values = {name: getattr(config, name) for name in names if hasattr(config, name)}
        return cls(**values, live=live, max_restarts=max_restarts, world_size=world_size)

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
        return {
            **dataclasses.asdict(self),
            "step_samples": cut[0],
            "step_micro_batch_size": cut[1],
            "step_micro_batches": cut[2],
            "world_divisors": ", ".join(str(d) for d in range(1, world + 1) if world % d == 0),
            "even_step_samples": rounded * cut[1],
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
        values = _PLACEHOLDERS_FACTS if settings is None else settings.facts()
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
)
_PLACEHOLDERS_FACTS = {
    "world_size": "N",
    "shard_degree": "S",
    "world_divisors": "1, ..., N",
    "even_step_samples": "G'",
    "step_micro_batches": "K",
    "step_micro_batch_size": "M",
    "step_samples": "G",
}


@dataclass(frozen=True)
class Plan:
    """A run's settings, checked against the table: the fallbacks that apply (a refusal raised when built)."""

    settings: RunSettings
    fallbacks: tuple[Rule, ...]

    @classmethod
    def of(cls, settings: RunSettings, *, flags: bool = False) -> Plan:
        """The plan, or PlanRefused for the first refused pair, else the first value check that refuses (its
        line spelled as flags, or as Python)."""
        fallbacks = []
        for first, second in itertools.combinations(settings.keys(), 2):
            rule = rule_for(first, second)
            if rule.verdict is Verdict.REFUSED:
                raise PlanRefused(rule.line(settings.facts(), flags=flags), rule)
            if rule.verdict is Verdict.FALLS_BACK:
                fallbacks.append(rule)
        for check in VALUE_CHECKS:
            if check.refuses(settings):
                raise PlanRefused(check.line(settings, flags=flags), check)
        return cls(settings, tuple(fallbacks))

    @property
    def reduction(self) -> Reduction:
        """The engine's mode: a periodic sync (deterministic or not), else exact sums in deterministic mode,
        else buckets."""
        if f"sync={self.settings.sync}" in SYNC_KEYS:
            return Reduction.PERIODIC
        return Reduction.EXACT if self.settings.deterministic else Reduction.BUCKETED

    def fallback(self, key: str) -> Rule | None:
        """The first fallback whose first setting is `key` (the one that does not apply), or None."""
        return next((r for r in self.fallbacks if r.first == key), None)

    def notes(self, *, flags: bool = True) -> list[str]:
        """One line per fallback, for the launcher to print once."""
        return [rule.line(self.settings.facts(), flags=flags) for rule in self.fallbacks]


def flag_verdicts(key: str) -> str:
    """What the table says of the setting `key` against the others, as `lockstep train --help` shows it:
    "refused with --sync diloco, ...; falls back with ...; refused ..." ('' where every pair runs)."""
    parts = []
    for verdict in (Verdict.REFUSED, Verdict.FALLS_BACK):
        others = [
            flag_of(r.second if r.first == key else r.first)
            for r in RULES
            if r.verdict is verdict
            and key in (r.first, r.second)
            and not {r.first, r.second} & set(PYTHON_ONLY)
        ]
        if others:
            parts.append(f"{verdict.value} with {', '.join(dict.fromkeys(others))}")
    parts += [f"refused {check.short}" for check in VALUE_CHECKS if check.key == key]
    return "; ".join(parts)


def markdown_table() -> str:
    """The compatibility table as docs/modes.md shows it: every pair that does not simply run."""
    rows = ["| settings | verdict | why | instead |", "|---|---|---|---|"]
    for rule in RULES:
        first, second = flag_of(rule.first), flag_of(rule.second)
        pair = f"`{first}` {rule.joined} `{second}`"
        rows.append(f"| {pair} | {rule.verdict.value} | {rule.reason} | {rule.instead or '-'} |")
    for check in VALUE_CHECKS:  # the checks on values, after the pairs
        case = check.flag.format(**_PLACEHOLDERS_FACTS)
        instead = check.instead_flag.format(**_PLACEHOLDERS_FACTS)
        rows.append(f"| `{case}` | {Verdict.REFUSED.value} | {check.reason} | {instead} |")
    return "\n".join(rows) + "\n"


def check_shard_layout(world_size: int, shard_degree: int) -> None:
    """The shard layout's checks at a door without a FitConfig (the engine's): PlanRefused, spelled as Python,
    where `shard_degree` ranks per shard group do not make a whole number of groups of `world_size` ranks
    (the checks every other door makes in `Plan.of`); ConfigError for a count below 1."""
    for name, value in (("world_size", world_size), ("shard_degree", shard_degree)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected an int >= 1")
    settings = RunSettings(world_size=world_size, shard_degree=shard_degree)
    for check in SHARD_LAYOUT_CHECKS:
        if check.refuses(settings):
            raise PlanRefused(check.line(settings, flags=False), check)
