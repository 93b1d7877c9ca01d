"""`make testbed` installs every package the testbed fixtures name in their skip reasons (they install nothing)."""

from __future__ import annotations

import re
from pathlib import Path

from testbed import netns, slurm_cluster
from testbed.system import SETUP_COMMAND, require_commands

ROOT = Path(__file__).resolve().parents[2]


def _makefile_packages() -> set[str]:
    match = re.search(r"^TESTBED_PACKAGES\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile has no TESTBED_PACKAGES line"
    return set(match.group(1).split())


def test_make_testbed_installs_every_package_the_fixtures_need() -> None:
    needed = set(netns.PACKAGES) | set(slurm_cluster.PACKAGES)
    assert needed <= _makefile_packages(), needed - _makefile_packages()
    assert re.search(r"^testbed:", (ROOT / "Makefile").read_text(), re.MULTILINE)


def test_a_missing_command_is_a_skip_reason_naming_the_setup_step() -> None:
    reason = require_commands(("sh", "no-such-command-lockstep"), ("some-package",))
    assert reason == (
        "no-such-command-lockstep not found on PATH (Debian packages some-package); "
        f"run `{SETUP_COMMAND}` as root once to install them"
    )
    assert require_commands(("sh",), ("dash",)) is None
