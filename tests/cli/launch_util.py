"""Helpers for the `lockstep run` end-to-end tests: write a script, run the CLI with a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

RUN_TIMEOUT = 120.0  # a hang fails the test; a loaded 2-core machine still finishes a run in ~10-20 s


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source).lstrip())
    return path


def lockstep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lockstep", *args]


def child_env(**extra: str | None) -> dict[str, str]:
    """The test's environment without launcher variables, plus `extra` (None removes a variable)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_cli(
    *args: str, cwd: Path, timeout: float = RUN_TIMEOUT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        lockstep_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or child_env()
    )
