"""The run's plan: which of a run's settings combine, decided once from one table, before any worker starts.

A run's modes come from a handful of settings (deterministic, live, the optimizer's overlap and sharding,
the sync mode and what it sends, its warm-up and fragments, the bucket size, accumulation, clipping,
precision, restarts, the engine's own knobs). Every pair of them either runs, falls back (one of the two
does not apply, and the run says why, once) or is refused (with what to do instead). This module holds
that table (`RULES`; a pair not in it runs) and the two checks on values that no pair states
(`VALUE_CHECKS`: deterministic mode needs a global batch; float live mode needs a micro-batch of every step
per rank), and nothing else decides them. Each door builds the plan once, from its own names, and hands it
down:

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
import enum
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lockstep.errors import ConfigError

# The sync modes' names (SyncPolicy.sync, FitConfig.sync): every step, then the periodic ones.
SYNC_MODES = ("allreduce", "local_sgd", "diloco", "streaming_diloco")
SYNC_KEYS = tuple(f"sync={mode}" for mode in SYNC_MODES[1:])  # the periodic ones
# a sync other than streaming DiLoCo's, which has no fragments
UNFRAGMENTED_SYNC_KEYS = tuple(f"sync={mode}" for mode in SYNC_MODES[:-1])
# streaming_diloco's fragment layouts (SyncPolicy.fragment_layout, FitConfig.fragment_layout; engine/periodic/fragments.py)
FRAGMENT_LAYOUTS = ("strided", "sliced", "contiguous")
# What a periodic sync's values travel in (FitConfig.sync_dtype, SyncPolicy.delta_dtype): casts, then the
# quantized formats of the outer gradients (engine/core/outer_codec.py).
SYNC_DTYPES = ("fp32", "bf16", "fp16", "int8", "int4", "fp4_e3m0")
QUANTIZED_SYNC_DTYPES = SYNC_DTYPES[3:]


class Reduction(enum.Enum):
    """How a replica's gradients meet: the engine's mode, which the plan decides from the settings."""

    BUCKETED = "bucketed"  # averaged during backward, bucket by bucket (torch's DDP, the default)
    EXACT = "exact"  # deterministic mode: exact fixed-point sums of the step's micro-batches
    PERIODIC = "periodic"  # not in backward: the replicas meet every sync_every steps (local SGD, DiLoCo)


class Verdict(enum.Enum):
    RUNS = "runs"
    FALLS_BACK = "falls back"
    REFUSED = "refused"


@dataclass(frozen=True)
class Setting:
    """One setting as the table names it, as a command line writes it and as Python writes it."""

    key: str
    flag: str  # both formatted with the RunSettings' fields (the bucket size's value, ...)
    python: str


SETTINGS: tuple[Setting, ...] = (
    Setting("deterministic", "--deterministic", "deterministic=True"),
    Setting("live", "--min-world", "live mode (--min-world)"),
    Setting("overlap_optimizer", "--overlap-optimizer true", "overlap_optimizer=True"),
    Setting("shard_optimizer", "--shard-optimizer true", "shard_optimizer=True"),
    Setting("sync=allreduce", "--sync allreduce", "sync='allreduce'"),
    Setting("sync=local_sgd", "--sync local_sgd", "sync='local_sgd'"),
    Setting("sync=diloco", "--sync diloco", "sync='diloco'"),
    Setting("sync=streaming_diloco", "--sync streaming_diloco", "sync='streaming_diloco'"),
    *(Setting(f"sync_dtype={d}", f"--sync-dtype {d}", f"sync_dtype={d!r}") for d in QUANTIZED_SYNC_DTYPES),
    Setting("sync_warmup", "--sync-warmup {sync_warmup}", "sync_warmup={sync_warmup}"),
    Setting("fragments", "--fragments {fragments}", "fragments={fragments}"),
    Setting("fragment_delay", "--fragment-delay {fragment_delay}", "fragment_delay={fragment_delay}"),
    Setting("bucket_cap_mb=auto", "--bucket-cap-mb auto", "bucket_cap_mb='auto'"),
    Setting("bucket_cap_mb", "--bucket-cap-mb {bucket_cap_mb}", "bucket_cap_mb={bucket_cap_mb!r}"),
    Setting(
        "grad_accum_steps", "--grad-accum-steps {grad_accum_steps}", "grad_accum_steps={grad_accum_steps}"
    ),
    Setting("clip_grad_norm", "--clip-grad-norm {clip_grad_norm}", "clip_grad_norm"),
    Setting("precision=bf16", "--precision bf16", "precision='bf16'"),
    Setting("precision=fp16", "--precision fp16", "precision='fp16'"),
    Setting("max_restarts", "--max-restarts {max_restarts}", "max_restarts"),
    # The engine's own knobs (SyncPolicy, the drop-in class's arguments): no flag of `lockstep train`.
    Setting("static_graph", "static_graph=True", "static_graph=True"),
    Setting("gradient_as_bucket_view", "gradient_as_bucket_view=True", "gradient_as_bucket_view=True"),
    Setting("find_unused_parameters", "find_unused_parameters=True", "find_unused_parameters=True"),
    Setting("torch_bucket_layout", "torch_bucket_layout=True", "torch_bucket_layout=True"),
    Setting("reduce_dtype", "reduce_dtype={reduce_dtype}", "reduce_dtype={reduce_dtype}"),
    # The native live API (trainer/live/live_loop.py): the steps driven by a LiveLoop of the user's.
    Setting("live_loop", "LiveLoop(...)", "LiveLoop(...)"),
)
ENGINE_KNOBS = (
    "static_graph",
    "gradient_as_bucket_view",
    "find_unused_parameters",
    "torch_bucket_layout",
    "reduce_dtype",
)
# The settings that no flag of `lockstep train` sets: the engine's knobs and LiveLoop.
PYTHON_ONLY = (*ENGINE_KNOBS, "live_loop")
_BY_KEY = {s.key: s for s in SETTINGS}


@dataclass(frozen=True)
class Rule:
    """What a pair of settings does together. `joined` is the words between the two settings' names."""

    first: str
    second: str
    verdict: Verdict
    reason: str
    instead: str = ""
    joined: str = "with"

    def line(self, settings: RunSettings, *, flags: bool) -> str:
        """One line naming both settings (as flags, or as Python spells them), why, and what to do instead."""
        a, b = (_name(_BY_KEY[k], settings, flags) for k in (self.first, self.second))
        text = f"{a} {self.joined} {b}: {self.reason}"
        return f"{text}; {self.instead}" if self.instead else text


def _name(setting: Setting, settings: RunSettings | None, flags: bool) -> str:
    """The setting as the user wrote it (None: as the table shows it, with a placeholder for the value)."""
    values = _PLACEHOLDERS if settings is None else dataclasses.asdict(settings)
    return (setting.flag if flags else setting.python).format(**values)


_PLACEHOLDERS = {
    "bucket_cap_mb": "MB",
    "grad_accum_steps": "K",
    "clip_grad_norm": "X",
    "max_restarts": "R",
    "reduce_dtype": "DTYPE",
    "sync_warmup": "N",
    "fragments": "F",
    "fragment_delay": "D",
}


_OVERLAP_MICRO = (
    "fit's steps in deterministic and live mode run through accumulate(), which has the step's mean only "
    "after its last backward: the optimizer steps once after it (the same bits)"
)
_OVERLAP_PERIODIC = (
    "no gradient is averaged in backward: there is nothing to overlap the step with (the same bits)"
)
_NO_BUCKETS = "that reduction has no gradient buckets to size"
_NO_CAP = "leave the bucket size unset"
_EXACT = "deterministic mode sums gradients exactly in its own format, without buckets"
_NOT_IN_BACKWARD = "a periodic sync averages no gradient in backward"
_NO_SHARED_STEP = "each rank steps all of its own parameters between syncs; there is no shared step to shard"


_NO_ROUNDS = "every step averages the gradients already: there are no rounds to warm up (the same bits)"
_NO_FRAGMENTS = "only streaming DiLoCo syncs the model in fragments"
_NOT_QUANTIZED = (
    "a quantized dtype applies to a periodic sync's outer gradients only (diloco, streaming_diloco): the "
    "every-step all-reduce averages the gradients in fp32"
)

_PARAMETERS_ROUNDED = (
    "local SGD averages the parameters themselves, which a quantized wire would round every round (only "
    "DiLoCo's outer gradients, anchor - local, are quantized)"
)


def _rules() -> Iterator[Rule]:
    refused, falls_back = Verdict.REFUSED, Verdict.FALLS_BACK
    for dtype in QUANTIZED_SYNC_DTYPES:
        yield Rule(
            f"sync_dtype={dtype}",
            "sync=local_sgd",
            refused,
            _PARAMETERS_ROUNDED,
            "use --sync diloco (or streaming_diloco) to send quantized outer gradients, or send fp32 or bf16",
            "does not apply with",
        )
        yield Rule(
            f"sync_dtype={dtype}", "sync=allreduce", falls_back, _NOT_QUANTIZED, "", "does not apply with"
        )
    for sync in SYNC_KEYS:
        yield Rule(
            "shard_optimizer",
            sync,
            refused,
            _NO_SHARED_STEP,
            "choose one of the two (sharding with the every-step sync)",
        )
        yield Rule("overlap_optimizer", sync, falls_back, _OVERLAP_PERIODIC)
        for cap in ("bucket_cap_mb=auto", "bucket_cap_mb"):
            yield Rule(cap, sync, refused, _NO_BUCKETS, _NO_CAP, "does not apply with")
        for knob in ("static_graph", "gradient_as_bucket_view", "find_unused_parameters"):
            yield Rule(
                knob, sync, refused, _NOT_IN_BACKWARD, f"leave {knob} at the default", "does not apply with"
            )
    for knob in ("static_graph", "gradient_as_bucket_view", "torch_bucket_layout", "reduce_dtype"):
        yield Rule(
            knob, "deterministic", refused, _EXACT, f"leave {knob} at the default", "does not apply with"
        )
    yield Rule(
        "bucket_cap_mb=auto",
        "torch_bucket_layout",
        refused,
        "torch's layout fixes the buckets: there are none of lockstep's to time",
        "pass a number of MiB",
        "does not apply with",
    )
    for cap in ("bucket_cap_mb=auto", "bucket_cap_mb"):
        yield Rule(cap, "deterministic", refused, _NO_BUCKETS, _NO_CAP, "does not apply with")
    yield Rule(
        "bucket_cap_mb=auto",
        "live",
        refused,
        "its trials are not made to survive a lost rank, so it does not run in live mode yet",
        "pass a number of MiB, or leave the bucket size unset",
        "does not apply with",
    )
    yield Rule("overlap_optimizer", "deterministic", falls_back, _OVERLAP_MICRO)
    yield Rule("overlap_optimizer", "live", falls_back, _OVERLAP_MICRO)
    yield Rule(
        "overlap_optimizer",
        "clip_grad_norm",
        falls_back,
        "gradient clipping by global norm needs every gradient before any parameter steps",
    )
    yield Rule(
        "overlap_optimizer",
        "precision=fp16",
        falls_back,
        "the fp16 GradScaler's inf check needs every gradient before any parameter steps (a step with an inf or "
        "NaN gradient is skipped as a whole)",
    )
    yield Rule(
        "grad_accum_steps",
        "deterministic",
        falls_back,
        "deterministic mode cuts each step's global batch (global_batch_size) into micro-batches of "
        "micro_batch_size; grad_accum_steps does not apply",
    )
    yield Rule("sync_warmup", "sync=allreduce", falls_back, _NO_ROUNDS, "", "does not apply with")
    yield Rule(
        "sync_warmup",
        "live",
        refused,
        "live mode's rounds go back to the last outer sync, which a warm-up does not have",
        "leave sync_warmup at 0",
        "does not apply with",
    )
    for sync in UNFRAGMENTED_SYNC_KEYS:
        yield Rule(
            "fragments",
            sync,
            refused,
            _NO_FRAGMENTS,
            "leave fragments at 1, or use sync streaming_diloco",
            "does not apply with",
        )
        yield Rule(
            "fragment_delay",
            sync,
            refused,
            _NO_FRAGMENTS + ": there is no fragment's mean in flight to delay",
            "leave fragment_delay at 1, or use sync streaming_diloco",
            "does not apply with",
        )
    yield Rule(
        "shard_optimizer",
        "live_loop",
        refused,
        "LiveLoop does not re-cut a ShardedOptimizer's shares when the members change",
        "pass the optimizer itself, or use lockstep.fit with FitConfig(shard_optimizer=True) in live mode",
    )


RULES: tuple[Rule, ...] = tuple(r for r in _rules() if r.verdict is not Verdict.RUNS)
_TABLE = {frozenset((r.first, r.second)): r for r in RULES}


def rule_for(first: str, second: str) -> Rule:
    """The table's rule for a pair of setting keys (in either order); a pair not in the table runs."""
    for key in (first, second):
        if key not in _BY_KEY:
            raise ConfigError(f"no run setting {key!r}; the settings are {', '.join(_BY_KEY)}")
    return _TABLE.get(frozenset((first, second)), Rule(first, second, Verdict.RUNS, ""))


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
        return {
            **dataclasses.asdict(self),
            "step_samples": cut[0],
            "step_micro_batch_size": cut[1],
            "step_micro_batches": cut[2],
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
        instead = self.instead_flag if flags else self.instead_python
        return f"{case}: {self.reason}; {instead}"


def _needs_a_global_batch(s: RunSettings) -> bool:
    return s.batch_size is not None and s.deterministic and s.global_batch_size is None


def _too_few_micro_batches(s: RunSettings) -> bool:
    cut = s.live_cut()
    return s.live and not s.deterministic and cut is not None and cut[2] < s.world_size


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
)
_PLACEHOLDERS_FACTS = {
    "world_size": "N",
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
                raise PlanRefused(rule.line(settings, flags=flags), rule)
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
        return [rule.line(self.settings, flags=flags) for rule in self.fallbacks]


def flag_of(key: str) -> str:
    """The setting `key` as the table shows it on the command line (a placeholder for its value)."""
    return _name(_BY_KEY[key], None, flags=True)


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
        first, second = (_name(_BY_KEY[key], None, flags=True) for key in (rule.first, rule.second))
        pair = f"`{first}` {rule.joined} `{second}`"
        rows.append(f"| {pair} | {rule.verdict.value} | {rule.reason} | {rule.instead or '-'} |")
    for check in VALUE_CHECKS:  # the checks on values, after the pairs
        case = check.flag.format(**_PLACEHOLDERS_FACTS)
        rows.append(f"| `{case}` | {Verdict.REFUSED.value} | {check.reason} | {check.instead_flag} |")
    return "\n".join(rows) + "\n"
