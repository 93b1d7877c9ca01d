"""Settings from outside Python: config files (JSON or YAML), `--key value` flags, and the checked mapping
they make, each value named with where it came from when it is wrong.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from lockstep.errors import ConfigError
from lockstep.trainer.settings.config import Source, check_setting, field_types

C = TypeVar("C")


def config_from_mapping(
    cls: type[C], values: Mapping[str, Any], source: Source | Mapping[str, Source] | None = None
) -> C:
    """Build config dataclass `cls` from plain values, each checked against its field and named with its source.

    `source` is one Source for all values (a file), or one per key (keys from a file and from --flags);
    a key without a source counts as Python code.
    """
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]

    def source_of(name: str) -> Source:
        if isinstance(source, Source):
            return source
        return (source or {}).get(name) or Source.python(cls)

    unknown = sorted(set(values) - known)
    if unknown:
        described = ", ".join(_unknown_text(name, source_of(name), known) for name in unknown)
        raise ConfigError(
            f"unknown setting(s) for {cls.__name__}: {described}; known settings: {', '.join(sorted(known))}"
        )
    checked = {name: check_setting(cls, name, value, source_of(name)) for name, value in values.items()}
    return cls(**checked)


def _unknown_text(name: str, source: Source, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{name!r} from {source.label}{hint}"


def read_overrides(
    tokens: Sequence[str], switches: Collection[str] = ()
) -> tuple[dict[str, str], dict[str, Source]]:
    """`--key value` and `--key=value` pairs: the values by key (dashes become underscores) and their flags.

    A key in `switches` (the bool settings) may also stand alone: `--deterministic` means true.
    """
    values: dict[str, str] = {}
    sources: dict[str, Source] = {}
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"expected --key value, got {token!r}")
        flag, eq, value = token.partition("=")
        key = flag[2:].replace("-", "_")
        if not eq:
            alone = index + 1 >= len(tokens) or tokens[index + 1].startswith("--")
            if alone and key not in switches:
                raise ConfigError(f"{flag} needs a value: {flag} VALUE or {flag}=VALUE")
            if alone:
                value = "true"
            else:
                value = tokens[index + 1]
                index += 1
        values[key] = value
        sources[key] = Source.flag(flag)
        index += 1
    return values, sources


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
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"config file {str(path)!r} is not valid JSON: {exc} (a .yaml/.yml name reads YAML)"
            ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of settings, got {type(data).__name__}"
        )
    return data


def bool_settings(cls: type) -> set[str]:
    """The names of the bool fields of config dataclass `cls` (the --flags that may stand alone)."""
    return {name for name, hint in field_types(cls).items() if hint is bool}
