"""The lowest torch that pyproject.toml allows is the one the suite runs on (Makefile's TORCH_SPEC).

A lower bound that nothing tests is a promise nobody keeps: the checkpoint code calls an API added in
torch 2.6, and the drop-in class follows torch 2.13's DistributedDataParallel. So CI installs exactly
the lowest supported version, and this test fails if the bound and the installed version drift apart.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3])


def _lower_bound() -> str:
    match = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, 'pyproject.toml must declare torch with a lower bound: "torch>=X.Y"'
    return match.group(1)


def test_ci_installs_the_lowest_supported_torch() -> None:
    spec = re.search(r"^TORCH_SPEC \?= torch==([0-9.]+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert spec, "the Makefile must pin the torch it tests: TORCH_SPEC ?= torch==X.Y.Z"
    assert _version(spec.group(1))[:2] == _version(_lower_bound())[:2], (
        f"Makefile tests torch {spec.group(1)} but pyproject.toml allows torch>={_lower_bound()}: "
        "raise the bound or test the lowest version"
    )


def test_the_installed_torch_is_within_the_bound() -> None:
    assert _version(torch.__version__) >= _version(_lower_bound()), (torch.__version__, _lower_bound())
