"""Fixtures shared by the end-to-end modules (their helpers are in tests/helpers.py)."""

from __future__ import annotations

import pytest

from tests.helpers import tiny_run


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny job on this machine with `lockstep run -n 2` (no SLURM, one host): what every SLURM and
    multi-host run of it must match. Run once per session."""
    return tiny_run(tmp_path_factory.mktemp("tiny_reference"))
