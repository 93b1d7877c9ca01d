"""FitConfig: every setting of a training run in one dataclass, validated, readable from YAML/JSON and --key value."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from lockstep.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
TASKS = ("classification", "regression", "language_model")  # accuracy only for classification


@dataclass
class FitConfig:
    """Settings of `lockstep.fit`. Batch size is per rank: the global batch is batch_size * world_size * accum."""

    run_dir: str = "runs/default"
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; stops early when reached
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
    resume: str = "auto"  # auto | never
    seed: int = 0
    num_workers: int = 0
    device: str = "auto"  # auto | cpu | cuda
    progress: str = "auto"  # auto | bar | lines | none
    plot: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_schedule", self.lr_schedule, SCHEDULES)
        _choice("task", self.task, TASKS)
        _choice("resume", self.resume, ("auto", "never"))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("progress", self.progress, ("auto", "bar", "lines", "none"))
        for name in ("epochs", "batch_size", "grad_accum_steps", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be at least 1")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "num_workers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be 0 or more")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps={self.max_steps!r} must be at least 1 (or None for no limit)")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr!r} must be positive")


def _choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


C = TypeVar("C")


def config_from_mapping(cls: type[C], values: Mapping[str, Any]) -> C:
    """Build a config dataclass from plain values, naming unknown keys and coercing string values."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown!r} for {cls.__name__}; known: {', '.join(sorted(known))}")
    hints = typing.get_type_hints(cls)
    coerced = {name: coerce(name, value, hints[name]) for name, value in values.items()}
    return cls(**coerced)


def coerce(name: str, value: Any, annotation: Any) -> Any:
    """Turn a command-line string (or YAML scalar) into the field's type: int, float, bool, str or optional."""
    if not isinstance(value, str):
        return value
    options = [a for a in typing.get_args(annotation)] if _is_union(annotation) else [annotation]
    if type(None) in options and value.lower() in ("none", "null", ""):
        return None
    for option in options:
        if option is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"--{name.replace('_', '-')} {value!r}: expected true or false")
        if option in (int, float):
            try:
                return option(value)
            except ValueError:
                continue
        if option is str:
            return value
    raise ConfigError(f"--{name.replace('_', '-')} {value!r}: expected {annotation}")


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def parse_overrides(tokens: Sequence[str]) -> dict[str, str]:
    """`--key value` and `--key=value` pairs into a dict (dashes become underscores)."""
    values: dict[str, str] = {}
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"expected --key value, got {token!r}")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if index + 1 >= len(tokens):
                raise ConfigError(f"--{key} needs a value")
            value = tokens[index + 1]
            index += 1
        values[key.replace("-", "_")] = value
        index += 1
    return values


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (needs pyyaml) or JSON config file into a dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path} is YAML but pyyaml is not installed: pip install pyyaml") from None
        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of settings, got {type(data).__name__}")
    return data


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
