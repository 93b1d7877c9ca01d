"""The quickstart's programs run as the page says: each ```python block starts with `# NAME.py:`, a
```console block below it runs `$ lockstep run -n 2 NAME.py`, and the lines under that command are what
the run prints (rank 0's output; the launch line goes to stderr). Each program is written to a fresh
directory and run there under the real launcher on 2 gloo ranks, with a hard timeout.

The first program (the drop-in one) runs in the fast tier; the others are `slow` (make test-all)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DOCS, child_env, code_blocks

QUICKSTART = DOCS / "quickstart.md"
RUN_TIMEOUT = 240  # seconds: torch's import on 2 loaded cores dominates (about 40 s each here)
_NAME = re.compile(r"#\s*(\w+\.py):")


def programs() -> dict[str, str]:
    """name -> source of each ```python block that names its file on its first line."""
    found = {}
    for language, text in code_blocks(QUICKSTART):
        match = _NAME.match(text) if language == "python" else None
        if match:
            found[match.group(1)] = text
    return found


def runs() -> dict[str, tuple[list[str], list[str]]]:
    """program name -> (the command's arguments after `lockstep`, the lines the page says it prints)."""
    found = {}
    for language, text in code_blocks(QUICKSTART):
        if language != "console":
            continue
        command, *printed = text.strip().splitlines()
        assert command.startswith("$ lockstep "), (
            f"a console block that is not a lockstep command: {command!r}"
        )
        args = shlex.split(command.removeprefix("$ lockstep "))
        found[args[-1]] = (args, [line for line in printed if line.strip() and line.strip() != "..."])
    return found


def test_every_program_on_the_page_is_run_and_says_what_it_prints() -> None:
    assert list(programs()) == ["prog.py", "bitwise.py", "fit_prog.py"]
    assert list(runs()) == list(programs())
    for name, (args, printed) in runs().items():
        assert args[:3] == ["run", "-n", "2"], f"{name}: run it as `lockstep run -n 2 {name}`"
        assert printed, f"{name}: the page does not say what it prints"


@pytest.mark.parametrize(
    "name",
    [
        "prog.py",
        pytest.param("bitwise.py", marks=pytest.mark.slow),
        pytest.param("fit_prog.py", marks=pytest.mark.slow),
    ],
)
def test_program_prints_what_the_page_says(name: str, tmp_path: Path) -> None:
    (tmp_path / name).write_text(programs()[name])
    args, printed = runs()[name]
    result = subprocess.run(
        [sys.executable, "-m", "lockstep", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=child_env(),
    )
    assert result.returncode == 0, f"{name} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    lines = [line.strip() for line in result.stdout.splitlines()]
    missing = [line for line in printed if line.strip() not in lines]
    assert not missing, f"{name} did not print {missing}; it printed:\n{result.stdout}"
    assert "lockstep run: 2 processes x 1 node (world 2)" in result.stderr
