"""The table of lockstep/plan.py: the run settings as each door names them, and what every pair of them does.

`SETTINGS` names each setting as the table keys it, as a command line writes it and as Python writes it;
`RULES` says of each pair that does not simply run whether it falls back (one of the two does not apply,
said once) or is refused, why, and what to do instead (`rule_for`; a pair not in it runs). The plan
(lockstep/plan.py) checks a run's settings against it; docs/modes.md shows it. Standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
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
    Setting("shard_degree", "--shard-degree {shard_degree}", "shard_degree={shard_degree}"),
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

    def line(self, values: Mapping[str, object], *, flags: bool) -> str:
        """One line naming both settings (as flags, or as Python spells them, formatted with a run's
        `values`: RunSettings.facts()), why, and what to do instead."""
        a, b = (_name(_BY_KEY[k], values, flags) for k in (self.first, self.second))
        text = f"{a} {self.joined} {b}: {self.reason}"
        return f"{text}; {self.instead}" if self.instead else text


def _name(setting: Setting, values: Mapping[str, object] | None, flags: bool) -> str:
    """The setting as the user wrote it (None: as the table shows it, with a placeholder for the value)."""
    return (setting.flag if flags else setting.python).format(**(_PLACEHOLDERS if values is None else values))


_PLACEHOLDERS = {
    "shard_degree": "S",
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
    yield from _shard_degree_rules()


# Sharding the model (shard_degree > 1: FSDP inside each shard group, torch's FSDP2 fully_shard; HSDP over
# the world / shard_degree replica groups) against every other setting. A pair not named here runs:
# deterministic (its exact reduce-scatter; VALUE_CHECKS wants whole micro-batches per rank), clipping,
# accumulation, restarts (from checkpoints), bf16, the every-step sync, the periodic syncs (the replica
# groups meet every H steps on their shards, in any wire format, streaming's fragments cut over the shards;
# VALUE_CHECKS wants two groups or more, and no deterministic mode), reduce_dtype (SyncPolicy's knob: no
# door sets it beside shard_degree today; FSDP2's MixedPrecisionPolicy.reduce_dtype is where it would go).
_NOT_BUILT_LIVE = "LiveLoop replicates the program's model: live recovery of a sharded model is fit's"
_LIVE_INSTEAD = "use lockstep.fit (or lockstep train) for a sharded model in live mode"
_FSDP_UNITS = "FSDP2's units are the buckets: each wrapped block's gradients are one reduce-scatter"
_NOT_DDP = (
    "it is a knob of the replicated engine's buckets (torch's DDP), which a sharded model does not run: FSDP2 "
    "reduce-scatters each wrapped block's gradients itself"
)


def _shard_degree_rules() -> Iterator[Rule]:
    refused, falls_back = Verdict.REFUSED, Verdict.FALLS_BACK
    yield Rule(
        "shard_degree",
        "shard_optimizer",
        refused,
        "FSDP shards the optimizer's state with the parameters already (each rank steps its own shards)",
        "choose one of the two (shard_degree shards parameters, gradients and optimizer state; "
        "shard_optimizer the optimizer state alone)",
    )
    yield Rule("shard_degree", "live_loop", refused, _NOT_BUILT_LIVE, _LIVE_INSTEAD)
    yield Rule(
        "sync_warmup",
        "shard_degree",
        refused,
        "a warm-up averages whole gradients before the rounds start, and a sharded run's outer sync holds "
        "its local shards alone (not built)",
        "leave sync_warmup at 0",
        "does not apply with",
    )
    yield Rule(
        "overlap_optimizer",
        "shard_degree",
        falls_back,
        "FSDP2 steps the sharded optimizer after backward, each rank its own shards: there is no bucket's "
        "step to overlap with backward",
    )
    for cap in ("bucket_cap_mb=auto", "bucket_cap_mb"):
        yield Rule(cap, "shard_degree", falls_back, _FSDP_UNITS, "", "does not apply with")
    yield Rule(
        "precision=fp16",
        "shard_degree",
        refused,
        "a GradScaler over sharded gradients is not wired",
        "use precision bf16 (no scaler), or leave shard_degree at 1",
    )
    for knob in ("static_graph", "gradient_as_bucket_view", "find_unused_parameters", "torch_bucket_layout"):
        yield Rule(
            knob, "shard_degree", refused, _NOT_DDP, f"leave {knob} at the default", "does not apply with"
        )


RULES: tuple[Rule, ...] = tuple(r for r in _rules() if r.verdict is not Verdict.RUNS)
_TABLE = {frozenset((r.first, r.second)): r for r in RULES}


def rule_for(first: str, second: str) -> Rule:
    """The table's rule for a pair of setting keys (in either order); a pair not in the table runs."""
    for key in (first, second):
        if key not in _BY_KEY:
            raise ConfigError(f"no run setting {key!r}; the settings are {', '.join(_BY_KEY)}")
    return _TABLE.get(frozenset((first, second)), Rule(first, second, Verdict.RUNS, ""))


def flag_of(key: str) -> str:
    """The setting `key` as the table shows it on the command line (a placeholder for its value)."""
    return _name(_BY_KEY[key], None, flags=True)
