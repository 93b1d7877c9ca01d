"""Parse the values of `lockstep run`'s flags: HOST:PORT, N or MIN:MAX, KEY=VALUE lists, numbers.

Each parser raises ConfigError naming the flag and the value it was given, so that the command line and
the Python API (LaunchSpec, launch/spec.py) fail with the same message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lockstep.errors import ConfigError

DEFAULT_RDZV_PORT = 29400


def parse_endpoint(text: str, default_port: int = DEFAULT_RDZV_PORT) -> tuple[str, int]:
    """'host:port', 'host' or '[v6addr]:port' -> (host, port); ConfigError naming --rdzv-endpoint otherwise."""
    raw = text.strip()
    if raw.startswith("["):
        host, sep, rest = raw[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(
                f"--rdzv-endpoint {text!r} is not HOST:PORT; write an IPv6 address as [addr]:port"
            )
        port_text = rest[1:] if rest else ""
    elif raw.count(":") == 1:
        host, _, port_text = raw.partition(":")
    elif ":" in raw:
        raise ConfigError(f"--rdzv-endpoint {text!r} is ambiguous; write an IPv6 address as [addr]:port")
    else:
        host, port_text = raw, ""
    if not host:
        raise ConfigError(f"--rdzv-endpoint {text!r} has no host; expected HOST:PORT, e.g. 10.0.0.1:29400")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(
            f"--rdzv-endpoint {text!r} has port {port_text!r}, which is not a TCP port (0-65535); "
            f"expected HOST:PORT, e.g. {host}:{DEFAULT_RDZV_PORT}"
        )
    return host, int(port_text)


def parse_nnodes(text: str) -> tuple[int, int]:
    """'2' -> (2, 2); '1:4' -> (1, 4), as torchrun's --nnodes."""
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise ConfigError(f"--nnodes {text!r} is not N or MIN:MAX (integers), e.g. --nnodes 2") from None
    return low, high


def parse_key_values(items: Sequence[str], flag: str) -> dict[str, str]:
    """['a=1', 'b=2'] (or 'a=1,b=2' for --rdzv-conf) -> {'a': '1', 'b': '2'}."""
    pairs: dict[str, str] = {}
    for item in items:
        for part in item.split(",") if flag == "--rdzv-conf" else [item]:
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"{flag} {part!r} is not KEY=VALUE, e.g. {flag} is_host=1")
            pairs[key.strip()] = value.strip() if flag == "--rdzv-conf" else value
    return pairs


# Numeric flags are converted after parsing, not by argparse's `type=`: argparse turns a converter's
# ValueError into its own generic message, and only its ArgumentTypeError (no LockstepError) keeps ours.
def _number_flag(value: Any, flag: str, prog: str, convert: Callable[[str], Any], expects: str) -> Any:
    """A numeric flag as argparse left it (the text given, or the default untouched) -> its value."""
    if not isinstance(value, str):
        return value  # the default
    try:
        return convert(value)
    except ValueError:
        raise ConfigError(f"{flag} expects {expects}, got {value!r} (see `{prog} --help`)") from None


def int_flag(value: str | int | None, flag: str, prog: str) -> int | None:
    """An integer flag (-n, --max-restarts, --min-world, ...)."""
    return _number_flag(value, flag, prog, int, "an integer")


def factor_flag(value: str | float | None, flag: str, prog: str) -> float | None:
    """A factor flag (--evict-stragglers)."""
    return _number_flag(value, flag, prog, float, f"a number, e.g. {flag} 2")


def seconds_flag(value: str | float, flag: str, prog: str) -> float:
    """A duration flag in seconds (--hang-timeout, --monitor-interval)."""
    return _number_flag(value, flag, prog, float, "a number of seconds")
