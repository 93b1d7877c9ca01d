"""FitConfig: every setting of a training run in one dataclass, type-checked per field from Python, files and flags.

The check is a small coercion of our own driven by the dataclass annotations, not a library (pydantic,
msgspec): the fields are scalars (int, float, bool, str, optional), so a library would add a compiled core
dependency for ~100 lines, and every error must name lockstep's sources (FitConfig(...), a file, a --flag).
Reading files and flags into a checked config is trainer/settings/config_sources.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from lockstep.errors import ConfigError
from lockstep.plan import FRAGMENT_LAYOUTS, SYNC_DTYPES, SYNC_MODES, Plan, RunSettings

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
TASKS = ("classification", "regression", "language_model")  # accuracy only for classification
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
NONE_WORDS = ("none", "null")


@dataclass(frozen=True)
class Source:
    """Where a value came from: Python code (`FitConfig(...)`), a config file, or a `--flag`."""

    label: str
    kind: str = "python"  # python | file | flag

    @staticmethod
    def python(config_cls: type) -> Source:
        return Source(f"{config_cls.__name__}(...)", "python")

    @staticmethod
    def file(path: str | Path) -> Source:
        return Source(str(path), "file")

    @staticmethod
    def flag(flag: str) -> Source:
        return Source(flag, "flag")

    def example(self, name: str, value: Any) -> str:
        """How to write `name = value` in this source, for the fix part of a message."""
        if self.kind == "flag":
            return f"{self.label} {_flag_text(value)}"
        if self.kind == "file":
            return f"{name}: {json.dumps(value)}"
        return f"{name}={value!r}"


@dataclass(frozen=True)
class Bound:
    """The values a field allows beyond its type: a minimum (inclusive, or exclusive when `strict`) for
    numbers, choices for words (both for a field that takes either, like bucket_cap_mb)."""

    minimum: float | None = None
    strict: bool = False
    choices: tuple[str, ...] = ()

    def admits(self, value: Any) -> bool:
        if value is None:
            return True
        if isinstance(value, str):  # a number-or-word field (bucket_cap_mb) has both bounds
            return not self.choices or value in self.choices
        if self.minimum is None:
            return True
        return bool(value > self.minimum) if self.strict else bool(value >= self.minimum)

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(map(repr, self.choices))
        return self.number_text()

    def number_text(self) -> str:
        """The minimum alone: `> 0`, `>= 1`, or '' without one."""
        if self.minimum is None:
            return ""
        return f"{'>' if self.strict else '>='} {_number_text(self.minimum)}"


def at_least(minimum: int) -> Bound:
    return Bound(minimum=minimum)


def positive() -> Bound:
    return Bound(minimum=0, strict=True)


def one_of(*choices: str) -> Bound:
    return Bound(choices=choices)


@dataclass
class FitConfig:
    """Settings of `lockstep.fit`. Batch size is per rank: the global batch is batch_size * world_size * accum.

    global_batch_size fixes the global batch instead, whatever the world size (batch_size and
    grad_accum_steps are then derived): each rank takes global_batch_size / world_size samples per step,
    in micro-batches of micro_batch_size (default: all at once). deterministic=True (needs
    global_batch_size) gives the same bits at any world size: the step is cut into micro-batches of
    micro_batch_size (default: batch_size) over all ranks and reduced exactly (SyncPolicy(deterministic)).
    shard_optimizer=True shards the optimizer's state over the ranks (ZeRO-1, engine/optim/shard_optimizer.py):
    the same bits as without it for SGD and AdamW; checkpoints hold the full state; in live mode each
    share is kept by two ranks. Not with a sync other than allreduce. With overlap_optimizer too, the
    engine steps this rank's share of each bucket during backward and the owners' broadcasts start then.
    overlap_optimizer=True steps each bucket's parameters as soon as its averaged gradients are back,
    while backward goes on: the same bits as without (sgd, adamw, any schedule); with clip_grad_norm, fp16
    precision, an optimizer other than SGD/Adam/AdamW, deterministic or live mode the step stays plain,
    and a warning says why (ReplicaHandle.overlap_optimizer).
    bucket_cap_mb="auto" tries bucket caps of 1 to 100 MiB over the first steps and keeps the fastest
    (engine/buckets/bucket_tuner.py); summary.json reports the choice and every candidate's timings. Not with
    deterministic, live mode or a sync other than allreduce. None (the default) is torch's 25 MiB.
    sync other than "allreduce" (local_sgd, diloco, streaming_diloco) lets each rank take sync_every inner
    steps alone between outer syncs (engine/periodic/outer_sync.py). Checkpoints hold every rank's state: a run
    resumes exactly mid-round at the same world size, and from a round's end at any world size. In live
    mode (--min-world) local_sgd and diloco survive a lost rank: the survivors redo the round from its start
    (the last outer sync), and replacements join at a round's end (trainer/live/live_rounds.py, docs/live.md);
    streaming_diloco goes back to its last fragment's sync: the lost rank's progress since each fragment's
    last sync is dropped (not redone; summary.json's faults[].dropped and samples_dropped count its samples).
    shard_degree=N: N ranks share one copy of the model in shards (FSDP inside a shard group, torch's FSDP2
    `fully_shard`), and the world / N replica groups average their shards' gradients (HSDP); N = world is
    FSDP (ZeRO-3), 1 (the default) the replicated engine; N must divide the world. reshard_after_forward=False
    keeps the parameters unsharded from forward to backward (ZeRO-2-like: more memory, one all-gather less).
    Not with shard_optimizer, live mode, a periodic sync or fp16 (lockstep/plan.py's table, docs/modes.md).
    """

    run_dir: str = "runs/default"
    epochs: int = 1
    # optimizer steps; stops early when reached. Also the LR schedule's horizon: a run resumed with
    # another max_steps follows another schedule (exact resume keeps the setting)
    max_steps: int | None = None
    batch_size: int = 32
    grad_accum_steps: int = 1
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    sync_batchnorm: bool = False
    task: str = "classification"
    eval_every: int = 0  # optimizer steps between evaluations; 0 = at the end of every epoch
    log_every: int = 10
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0 = at the end of every epoch
    keep_checkpoints: int = 3
    # rank 0 copies the state to CPU memory at the save and writes it on a background thread while training
    # goes on (CheckpointManager.save(..., blocking=False)); summary.json's checkpoint_stall_s says what saves cost
    checkpoint_async: bool = False
    resume: str = "auto"  # auto | never
    seed: int = 0
    num_workers: int = 0
    device: str = "auto"  # auto | cpu | cuda
    progress: str = "auto"  # auto | bar | lines | none
    global_batch_size: int | None = None  # samples per optimizer step over all ranks; fixed at any world size
    micro_batch_size: int | None = None  # samples per forward/backward when global_batch_size is set
    deterministic: bool = False  # the same bits at any world size (needs global_batch_size)
    overlap_optimizer: bool = (
        False  # each bucket's parameters step during backward, once its averages are back
    )
    # Low-communication training (engine/periodic/outer_sync.py): "allreduce" averages gradients every step; local_sgd,
    # diloco and streaming_diloco let each rank step alone and sync every sync_every steps.
    sync: str = "allreduce"
    sync_every: int = 50  # H: inner steps between syncs (a fragment's, for streaming_diloco)
    outer_lr: float = 0.7  # DiLoCo's outer SGD learning rate
    outer_momentum: float = 0.9  # its Nesterov momentum (0: plain SGD)
    # data-parallel steps (gradients averaged) before the first outer round (not in live mode)
    sync_warmup: int = 0
    # DiLoCo: the outer momentum rises linearly from 0 to outer_momentum over a fragment's first
    # outer_momentum_warmup outer steps (0: outer_momentum from the first)
    outer_momentum_warmup: int = 10
    fragment_mix: float = 0.5  # streaming_diloco: the local share of a merge (alpha)
    fragment_layout: str = (
        "sliced"  # streaming_diloco: sliced | strided | contiguous (engine/periodic/fragments.py)
    )
    # streaming_diloco: the inner steps a fragment's mean is in flight (tau; 0 .. sync_every)
    fragment_delay: int = 1
    fragments: int = 1  # streaming_diloco: pieces of the model synced in turn
    # What the synced values travel in: fp32, bf16, fp16, or the outer gradients (diloco, streaming_diloco)
    # quantized per block of 128 with a float32 scale: int8, int4, fp4_e3m0 (engine/core/outer_codec.py); summed in fp32
    sync_dtype: str = "fp32"
    shard_optimizer: bool = (
        False  # ZeRO-1: each rank steps, and keeps the state of, its share of the parameters
    )
    shard_degree: int = 1  # ranks per shard group (FSDP2 fully_shard in each; HSDP over the groups)
    reshard_after_forward: bool = True  # sharded: free the gathered parameters after forward
    # MiB per gradient bucket: None is torch's 25 through the drop-in class (torch's layout and bits);
    # "auto" chooses it by measurement in the first steps (SyncPolicy(bucket_cap_mb="auto"), replicate).
    bucket_cap_mb: float | str | None = None

    # Allowed values beyond the annotation, by field. A subclass adds its own: the MRO is searched.
    BOUNDS: ClassVar[Mapping[str, Bound]] = {
        "epochs": at_least(1),
        "max_steps": at_least(1),
        "batch_size": at_least(1),
        "grad_accum_steps": at_least(1),
        "optimizer": one_of(*OPTIMIZERS),
        "lr": positive(),
        "weight_decay": at_least(0),
        "momentum": at_least(0),
        "lr_schedule": one_of(*SCHEDULES),
        "warmup_steps": at_least(0),
        "clip_grad_norm": positive(),
        "precision": one_of(*PRECISIONS),
        "task": one_of(*TASKS),
        "eval_every": at_least(0),
        "log_every": at_least(1),
        "checkpoint_every": at_least(0),
        "keep_checkpoints": at_least(1),
        "resume": one_of("auto", "never"),
        "num_workers": at_least(0),
        "device": one_of("auto", "cpu", "cuda"),
        "progress": one_of("auto", "bar", "lines", "none"),
        "global_batch_size": at_least(1),
        "micro_batch_size": at_least(1),
        "sync": one_of(*SYNC_MODES),
        "sync_every": at_least(1),
        "outer_lr": positive(),
        "outer_momentum": at_least(0),
        "sync_warmup": at_least(0),
        "outer_momentum_warmup": at_least(0),
        "fragment_mix": at_least(0),
        "fragment_layout": one_of(*FRAGMENT_LAYOUTS),
        "fragment_delay": at_least(0),
        "fragments": at_least(1),
        "shard_degree": at_least(1),
        "sync_dtype": one_of(*SYNC_DTYPES),
        "bucket_cap_mb": Bound(minimum=0, strict=True, choices=("auto",)),
    }

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field against its annotation and bound (ints given for floats become floats)."""
        source = Source.python(type(self))
        for f in fields(self):
            setattr(self, f.name, check_setting(type(self), f.name, getattr(self, f.name), source))


def plan_of(config: FitConfig, world_size: int, *, live: bool, min_world: int = 0) -> Plan:
    """fit's verdict on its settings (lockstep/plan.py: PlanRefused for a pair that does not combine, or for
    a value it checks: deterministic mode without a global batch, live mode without deterministic with fewer
    micro-batches than ranks, a shard_degree that does not divide the world size, sharded deterministic mode
    with a step's micro-batches not a multiple of the ranks), and the engine's mode; `lockstep train` asks the same table of the same
    settings before launch. `world_size`: the launched ranks (in live mode the launch's, which the
    micro-batch check counts, whatever the survivors)."""
    return Plan.of(RunSettings.of(config, world_size=world_size, live=live, min_world=min_world))


def check_setting(cls: type, name: str, value: Any, source: Source) -> Any:
    """`value` as field `name` of config dataclass `cls` holds it, or a ConfigError naming field, value, source."""
    hints = field_types(cls)
    bound = _bound(cls, name)
    try:
        converted = _convert(hints[name], value, source.kind)
        if not bound.admits(converted):
            raise ConfigError(f"got {converted!r}")
    except ConfigError as mismatch:  # the reason alone ("got a str"), from the helpers below
        expected = _describe(hints[name], bound, source.kind)
        default = _default(cls, name)
        fix = (
            f" (e.g. {source.example(name, default)}, the default)"
            if default is not dataclasses.MISSING
            else ""
        )
        raise ConfigError(
            f"{name}={value!r} from {source.label}: expected {expected}, {mismatch}{fix}"
        ) from None
    return converted


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _bound(cls: type, name: str) -> Bound:
    for klass in cls.__mro__:
        bounds = vars(klass).get("BOUNDS", {})
        if name in bounds:
            return bounds[name]
    return Bound()


def _default(cls: type, name: str) -> Any:
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name == name:
            return f.default
    return dataclasses.MISSING


def _options(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _convert(annotation: Any, value: Any, kind: str) -> Any:
    options = _options(annotation)
    if not all(option in (bool, int, float, str, type(None)) for option in options):
        return value  # a subclass's field of another type: its own validate() checks it
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError("got None")
    if kind == "flag" and isinstance(value, str):
        return _parse_text(options, value)
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(float(value))
        if option is str and isinstance(value, str):
            return value
    if kind == "file" and float in options and isinstance(value, str):
        # YAML 1.1 (pyyaml) reads `lr: 1e-3` as the string '1e-3': accept what float() reads as a number.
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None:
            return _finite(number)
    kind_name = type(value).__name__
    raise ConfigError(f"got {'an' if kind_name[0] in 'aeiou' else 'a'} {kind_name}")


def _parse_text(options: list[Any], text: str) -> Any:
    """A --flag's text as the first type of the annotation that reads it."""
    word = text.strip().lower()
    if type(None) in options and word in NONE_WORDS:
        return None
    for option in options:
        if option is bool and word in TRUE_WORDS + FALSE_WORDS:
            return word in TRUE_WORDS
        if option in (int, float):
            try:
                number = option(text)
            except ValueError:
                continue
            return _finite(number) if option is float else number
        if option is str:
            return text
    raise ConfigError("got text that does not read as one")


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ConfigError(f"got {value!r}")
    return value


def _describe(annotation: Any, bound: Bound, kind: str) -> str:
    """`an int >= 1`, `a float > 0 or none`, `one of 'auto', 'never'`."""
    options = _options(annotation)
    words = []
    for option in options:
        if option is type(None):
            continue
        if bound.choices and option is str:
            words.append(bound.describe())
            continue
        booleans = "True or False" if kind == "python" else "true or false"
        name = {bool: f"a bool ({booleans})", int: "an int", float: "a finite float", str: "a str"}[option]
        words.append(f"{name} {bound.number_text()}".strip() if option in (int, float) else name)
    if type(None) in options:
        words.append("none" if kind == "flag" else "None")
    return " or ".join(words)


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _flag_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
