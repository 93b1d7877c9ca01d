"""Shared test setup: single-threaded ranks, and the pool of rank processes.

Pool: run_distributed calls that a `lockstep.testing.RankPool` can serve (gloo, no `env`, up to 4 ranks)
run on rank processes kept alive across tests instead of fresh interpreters (a fresh group on a fresh
store each call; a failure, a hang or a worker not back in its starting state replaces the pool). A test
marked `fresh_ranks`, or one that reads the ranks' output with capfd/capsys (the pool's processes write
to the file descriptors they started with), gets fresh processes. LOCKSTEP_TEST_POOL=0 turns the pool off.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from lockstep.testing import RankPool, use_pool  # noqa: E402  (after OMP_NUM_THREADS: it imports torch)

_CAPTURING = {"capfd", "capfdbinary", "capsys", "capsysbinary"}
_POOL = RankPool(size=4) if os.environ.get("LOCKSTEP_TEST_POOL", "1") != "0" else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures (module-scoped ones included) are set up: pool or fresh processes."""
    fixtures = set(getattr(item, "fixturenames", ()))
    pooled = (
        _POOL is not None and item.get_closest_marker("fresh_ranks") is None and not fixtures & _CAPTURING
    )
    use_pool(_POOL if pooled else None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line on the pool: how many calls it served, how many processes it started, why it was replaced."""
    if _POOL is None or not _POOL.stats["calls"]:
        return
    stats = _POOL.stats
    why: dict[str, int] = {}
    for reason in stats["replaced"]:
        why[reason] = why.get(reason, 0) + 1
    replaced = "; ".join(f"{n} x {reason}" for reason, n in sorted(why.items())) or "never"
    terminalreporter.write_line(
        f"rank pool: {stats['calls']} calls on {stats['started']} started processes; replaced: {replaced}"
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    use_pool(None)
    if _POOL is not None:
        _POOL.close()
