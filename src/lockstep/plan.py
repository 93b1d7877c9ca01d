"""The run's plan: which of a run's settings combine, decided once from one table, before any worker starts.

A run's modes come from a handful of settings (deterministic, live, the optimizer's overlap and sharding,
the sync mode, the bucket size, accumulation, clipping, precision, restarts). Every pair of them either
runs, falls back (one of the two does not apply, and the run says why, once) or is refused (with what to
do instead). This module holds that table (`RULES`; a pair not in it runs) and nothing else decides it:

- `lockstep train` builds the plan from the settings and the launch before starting a worker, so a refused
  pair is one line and exit status 2, never a traceback per rank (`lockstep run` starts a program whose
  settings it does not know: the program's `fit` or SyncPolicy meets the refusal);
- the trainer and the engine ask the same plan (`Plan.of(...)`, `Plan.fallback(key)`) when they choose
  their modes, so a program that calls `lockstep.fit` without the launcher gets the same answer.

docs/modes.md shows the table as `markdown_table()` writes it (a test keeps the two equal). Standard
library only: the launcher imports it without torch.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from lockstep.errors import ConfigError

# The sync modes' names (SyncPolicy.sync, FitConfig.sync): every step, then the periodic ones.
SYNC_MODES = ("allreduce", "local_sgd", "diloco", "streaming_diloco")
SYNC_KEYS = tuple(f"sync={mode}" for mode in SYNC_MODES[1:])
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
    Setting("sync=local_sgd", "--sync local_sgd", "sync='local_sgd'"),
    Setting("sync=diloco", "--sync diloco", "sync='diloco'"),
    Setting("sync=streaming_diloco", "--sync streaming_diloco", "sync='streaming_diloco'"),
    *(Setting(f"sync_dtype={d}", f"--sync-dtype {d}", f"sync_dtype={d!r}") for d in QUANTIZED_SYNC_DTYPES),
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
)
ENGINE_KNOBS = (
    "static_graph",
    "gradient_as_bucket_view",
    "find_unused_parameters",
    "torch_bucket_layout",
    "reduce_dtype",
)
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
        "deterministic mode cuts each step's global batch into micro-batches of micro_batch_size; "
        "grad_accum_steps only sizes the global batch when global_batch_size is not given",
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
    """Two settings that do not combine: the message is one line naming both and what to do instead."""

    def __init__(self, message: str, rule: Rule) -> None:
        super().__init__(message)
        self.rule = rule


@dataclass(frozen=True)
class RunSettings:
    """The facts the plan decides from: a run's settings (FitConfig's names) and its launch."""

    deterministic: bool = False
    live: bool = False
    overlap_optimizer: bool = False
    shard_optimizer: bool = False
    sync: str = "allreduce"
    sync_dtype: str = "fp32"
    bucket_cap_mb: float | str | None = None
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    max_restarts: int = 0
    batch_size: int = 32
    global_batch_size: int | None = None
    world_size: int = 1
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    torch_bucket_layout: bool = False
    reduce_dtype: object = None  # a torch.dtype (this module does not import torch)

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
            f"sync={self.sync}": True,  # "sync=allreduce" (every step, the default) is no key of the table
            f"sync_dtype={self.sync_dtype}": True,  # nor are the casts (fp32, bf16, fp16)
            "bucket_cap_mb=auto": isinstance(cap, str),
            "bucket_cap_mb": cap is not None and not isinstance(cap, str),
            "grad_accum_steps": self.grad_accum_steps > 1,
            "clip_grad_norm": self.clip_grad_norm is not None,
            f"precision={self.precision}": True,  # "precision=fp32" is none either
            "max_restarts": self.max_restarts > 0,
            **{knob: bool(getattr(self, knob)) for knob in ENGINE_KNOBS[:-1]},
            "reduce_dtype": self.reduce_dtype is not None,
        }
        return [s.key for s in SETTINGS if on.get(s.key)]


@dataclass(frozen=True)
class Plan:
    """A run's settings, checked against the table: the fallbacks that apply (a refusal raised when built)."""

    settings: RunSettings
    fallbacks: tuple[Rule, ...]
    # deterministic mode without one: the per-rank batch on every launched rank (default_global_batch)
    global_batch_size: int | None

    @classmethod
    def of(cls, settings: RunSettings, *, flags: bool = False) -> Plan:
        """The plan, or PlanRefused for the first refused pair (its line spelled as flags, or as Python)."""
        fallbacks = []
        for first, second in itertools.combinations(settings.keys(), 2):
            rule = rule_for(first, second)
            if rule.verdict is Verdict.REFUSED:
                raise PlanRefused(rule.line(settings, flags=flags), rule)
            if rule.verdict is Verdict.FALLS_BACK:
                fallbacks.append(rule)
        return cls(settings, tuple(fallbacks), _global_batch(settings))

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
        """One line per fallback (and per value the plan chose), for the launcher to print once."""
        lines = [rule.line(self.settings, flags=flags) for rule in self.fallbacks]
        s = self.settings
        if s.sync_dtype in QUANTIZED_SYNC_DTYPES and self.reduction is not Reduction.PERIODIC:
            lines.append(
                f"--sync-dtype {s.sync_dtype} applies to a periodic sync's outer gradients only (--sync diloco or "
                "streaming_diloco): with --sync allreduce the gradients are averaged in fp32 every step"
            )
        if self.global_batch_size != s.global_batch_size:
            lines.append(
                f"--deterministic without --global-batch-size: the global batch is {self.global_batch_size} "
                f"(batch_size {s.batch_size} x grad_accum_steps {s.grad_accum_steps} x {s.world_size} ranks), "
                "fixed in config.json; pass --global-batch-size to choose it"
            )
        return lines


def _global_batch(settings: RunSettings) -> int | None:
    """Deterministic mode needs a global batch that does not depend on the world size; without one the
    launcher fixes the per-rank batch on every launched rank (live mode's default), saved in config.json
    so that a resume at another world size keeps it."""
    if settings.deterministic and settings.global_batch_size is None:
        return settings.batch_size * settings.grad_accum_steps * settings.world_size
    return settings.global_batch_size


def markdown_table() -> str:
    """The compatibility table as docs/modes.md shows it: every pair that does not simply run."""
    rows = ["| settings | verdict | why | instead |", "|---|---|---|---|"]
    for rule in RULES:
        first, second = (_name(_BY_KEY[key], None, flags=True) for key in (rule.first, rule.second))
        pair = f"`{first}` {rule.joined} `{second}`"
        rows.append(f"| {pair} | {rule.verdict.value} | {rule.reason} | {rule.instead or '-'} |")
    return "\n".join(rows) + "\n"
