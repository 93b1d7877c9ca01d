"""Shared test setup: single-threaded ranks, the two tiers, and the pool of rank processes.

Tiers (`make test` runs `pytest -m "not slow"`; `make test-all` runs everything, as CI does):

- A test that starts 3 or more ranks is `slow`, by rule: at collection, tests/tiers.py reads the world
  sizes the test asks for (`run_distributed(fn, N)`, `run_parity(cases, N)`, `-n N` on a command line,
  with N from a literal, a parametrize value, a module constant, a loop over literals or an argument of a
  helper it calls) in its code, the helpers it calls and the fixtures it uses, and this hook adds the
  mark. Nobody writes `slow` for a rank count (its 2-rank variant stays fast). The rule wins over `smoke`:
  a smoke test on 3+ ranks runs in `make test-all` only.
- Beyond that, tests/unit and tests/multiproc are in the fast tier unless marked `slow` by hand: only for
  what costs for another reason (trains for long, compiles, tests the rank pool itself).
- tests/cli (end to end) and tests/gpu are `slow` unless marked `smoke`: the fast tier keeps one smoke per
  CLI feature (run, failure summary, hang, deterministic resize, train; live mode's smokes start 4 ranks,
  so the rule above keeps them in `make test-all` until one runs on 2). A new end-to-end test goes to
  `make test-all` unless it is made the smoke of a new feature.

So a test added without a marker lands where its directory's cost and its rank count say. `smoke` outside
tests/cli and tests/gpu, and `smoke` together with a hand-written `slow`, are errors. A world size the
source cannot tell (computed at run time) escapes the rule; run_distributed's calls (those without `env`)
are also counted as they happen, and a fast-tier test that started 3 or more ranks that way fails, saying
so: write its world size as a literal, a parameter or a constant (or teach tests/tiers.py the form).

Pool: run_distributed calls that a `lockstep.testing.RankPool` can serve (gloo, no `env`, up to 4 ranks)
run on rank processes kept alive across tests instead of fresh interpreters (a fresh group on a fresh
store each call; a failure, a hang or a worker not back in its starting state replaces the pool). A test
marked `fresh_ranks`, or one that reads the ranks' output with capfd/capsys (the pool's processes write
to the file descriptors they started with), gets fresh processes. LOCKSTEP_TEST_POOL=0 turns the pool off.

Workers (pytest-xdist; `make test` runs `-n 2 --dist loadgroup`; `make test-all` runs everything but the
end-to-end tests so, then those in one process, alone on the cores): the
end-to-end tests (tests/cli, tests/gpu) are one xdist group, so they run one after the other on one
worker, as they would without xdist: their launchers, hang timeouts and stragglers never compete with
another end-to-end test, and a module's fixtures (a reference run, the SLURM cluster) are set up once.
The multi-process tests (tests/multiproc) are another group, one after the other on the other worker:
two of them at once, each forming process groups, failed now and then (a process group that could not
form within 90 s, an old bucket's memory counted twice in a pooled process); the unit and docs tests go to
whichever worker is free. Each worker has a rank pool of its own; the pools' lines are summed in the
controller's summary.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from lockstep.testing import RankPool, use_pool  # noqa: E402  (after OMP_NUM_THREADS: it imports torch)
from tests.tiers import MANY_RANKS, ranks_of_item  # noqa: E402

TESTS = Path(__file__).resolve().parent
SLOW_UNLESS_SMOKE = (TESTS / "cli", TESTS / "gpu")
END_TO_END_GROUP = "end_to_end"
MULTI_PROCESS, MULTI_PROCESS_GROUP = TESTS / "multiproc", "multi_process"
_CAPTURING = {"capfd", "capfdbinary", "capsys", "capsysbinary"}
_POOL = RankPool(size=4) if os.environ.get("LOCKSTEP_TEST_POOL", "1") != "0" else None
_SEEN = pytest.StashKey["_RanksSeen"]()
_WORKER_POOLS: list[dict[str, Any]] = []  # xdist's controller: each finished worker's pool stats


class _RanksSeen:
    """Where run_distributed routes its calls during one test (in place of the pool, to which it hands
    each on, or to fresh processes with None): the most ranks the test started that way."""

    def __init__(self, pool: RankPool | None) -> None:
        self.pool, self.most = pool, 0

    def try_run(self, fn: Any, world_size: int, **kwargs: Any) -> list[Any] | None:
        self.most = max(self.most, world_size)
        return self.pool.try_run(fn, world_size, **kwargs) if self.pool is not None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).resolve()
        end_to_end = any(path.is_relative_to(d) for d in SLOW_UNLESS_SMOKE)
        smoke, slow = item.get_closest_marker("smoke"), item.get_closest_marker("slow")
        if smoke and not end_to_end:
            raise pytest.UsageError(f"{item.nodeid}: `smoke` is for tests/cli and tests/gpu only")
        if smoke and slow:
            raise pytest.UsageError(f"{item.nodeid}: marked both `smoke` and `slow`")
        many_ranks = max(ranks_of_item(item), default=0) >= MANY_RANKS
        if many_ranks or (end_to_end and not smoke):
            item.add_marker(pytest.mark.slow)
        if end_to_end:  # one after the other on one xdist worker (see the module doc)
            item.add_marker(pytest.mark.xdist_group(END_TO_END_GROUP))
        elif path.is_relative_to(MULTI_PROCESS):  # the same: never two at once (see the module doc)
            item.add_marker(pytest.mark.xdist_group(MULTI_PROCESS_GROUP))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures (module-scoped ones included) are set up: pool or fresh processes."""
    fixtures = set(getattr(item, "fixturenames", ()))
    pooled = (
        _POOL is not None and item.get_closest_marker("fresh_ranks") is None and not fixtures & _CAPTURING
    )
    seen = item.stash[_SEEN] = _RanksSeen(_POOL if pooled else None)
    use_pool(seen)  # type: ignore[arg-type]  # a RankPool's try_run, counted


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """After the test (its fixtures' setup included): a fast-tier test must not have started 3+ ranks."""
    result = yield
    seen = item.stash.get(_SEEN, None)
    if seen is not None and seen.most >= MANY_RANKS and item.get_closest_marker("slow") is None:
        pytest.fail(
            f"{item.nodeid} started {seen.most} ranks in the fast tier: tests/tiers.py did not read that "
            "world size from its source; write it as a literal, a parameter or a module constant (or teach "
            "tests/tiers.py the form it takes) so that the rule of tests/conftest.py marks the test slow"
        )
    return result


def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist's controller: keep what a worker's pool did, for the summary line (pytest_sessionfinish)."""
    stats = getattr(node, "workeroutput", {}).get("rank_pool")
    if stats:
        _WORKER_POOLS.append(stats)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line on the pool: how many calls it served, how many processes it started, why it was replaced
    (under xdist: the workers' pools together)."""
    pools = [*_WORKER_POOLS, *([_POOL.stats] if _POOL is not None else [])]
    stats = {
        "calls": sum(p["calls"] for p in pools),
        "started": sum(p["started"] for p in pools),
        "replaced": [reason for p in pools for reason in p["replaced"]],
    }
    if not stats["calls"]:
        return
    why: dict[str, int] = {}
    for reason in stats["replaced"]:  # one reason per call, whichever ranks gave it
        key = "; ".join(sorted({re.sub(r"^rank \d+: ", "", part) for part in reason.split("; ")}))
        why[key] = why.get(key, 0) + 1
    replaced = "; ".join(f"{n} x {reason}" for reason, n in sorted(why.items())) or "never"
    terminalreporter.write_line(
        f"rank pool: {stats['calls']} calls on {stats['started']} started processes; replaced: {replaced}"
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    use_pool(None)
    if _POOL is not None:
        _POOL.close()
        worker_output = getattr(session.config, "workeroutput", None)  # set on an xdist worker only
        if worker_output is not None:
            worker_output["rank_pool"] = {k: _POOL.stats[k] for k in ("calls", "started", "replaced")}
