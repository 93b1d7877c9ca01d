"""lockstep.testing.RankPool: run_distributed's contract on processes kept across calls, and a fresh pool
whenever a call fails, hangs or leaves a worker in another state than it found it."""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep.errors import DistributedTestError
from lockstep.testing import RankPool, run_distributed, use_pool

# Each test makes its own pools (run_distributed here is the real one); replacing a pool starts fresh
# processes, so these are costly: make test-all. Every pooled test of the fast tier exercises the pool too.
pytestmark = [pytest.mark.fresh_ranks, pytest.mark.slow]


@pytest.fixture
def pool() -> Iterator[RankPool]:
    with RankPool(size=3) as made:
        yield made


def _facts(tag: str) -> dict[str, object]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": t.item(),
        "pid": os.getpid(),
        "random": torch.randn(2).tolist(),
        "tag": tag,
        "env": os.environ.get("LOCKSTEP_POOL_TEST"),
    }


def test_a_call_gives_run_distributeds_results_and_the_processes_are_reused(pool: RankPool) -> None:
    fresh = run_distributed(_facts, 2, args=("x",), timeout=60)
    first = pool.run(_facts, 2, args=("x",), timeout=60)
    second = pool.run(_facts, 2, args=("x",), timeout=60, env={"LOCKSTEP_POOL_TEST": "set"})
    third = pool.run(_facts, 3, args=("y",), timeout=60)
    strip = ("pid", "env", "random")
    assert [{k: v for k, v in r.items() if k not in strip} for r in first] == [
        {k: v for k, v in r.items() if k not in strip} for r in fresh
    ]
    assert [r["pid"] for r in second] == [r["pid"] for r in first]  # the same processes
    # ...each call starting from the random state the process started with (torch seeds a new process at
    # random: nothing an earlier call drew shows in a later one)
    assert [r["random"] for r in second] == [r["random"] for r in first]
    assert [r["env"] for r in second] == ["set", "set"] and [r["env"] for r in first] == [None, None]
    assert [r["env"] for r in third] == [None] * 3  # the environment is restored after each call
    assert [r["pid"] for r in third[:2]] == [r["pid"] for r in first] and [r["sum"] for r in third] == [
        6.0
    ] * 3
    assert pool.stats["started"] == 3 and pool.stats["replaced"] == []


def _raise_on_rank1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from the pool test")


def _hang_on_rank0(pid_file: str) -> None:
    Path(f"{pid_file}.{dist.get_rank()}").write_text(str(os.getpid()))
    if dist.get_rank() == 0:
        time.sleep(600)


def _exit_hard() -> None:
    if dist.get_rank() == 1:
        os._exit(7)


def test_a_failure_is_reported_like_run_distributeds_and_the_next_call_gets_fresh_processes(
    pool: RankPool, tmp_path: Path
) -> None:
    before = [r["pid"] for r in pool.run(_facts, 2, args=("a",), timeout=60)]
    with pytest.raises(
        DistributedTestError, match=r"\[rank 1/2\] raised:(.|\n)*ValueError: boom from the pool"
    ):
        pool.run(_raise_on_rank1, 2, timeout=60)
    after = [r["pid"] for r in pool.run(_facts, 2, args=("b",), timeout=60)]
    assert not set(before) & set(after)
    with pytest.raises(DistributedTestError, match=r"\[rank 1/2\] exited with code 7"):
        pool.run(_exit_hard, 2, timeout=60)
    pool.run(_facts, 2, args=("warm",), timeout=60)  # started: the hang's 10 s are the call's alone
    with pytest.raises(DistributedTestError, match=r"\[rank 0/2\] did not finish within 10 s"):
        pool.run(_hang_on_rank0, 2, args=(str(tmp_path / "pid"),), timeout=10)
    for rank in (0, 1):  # both were killed with the pool, the hung one and the one that had finished
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid.{rank}").read_text()), 0)
    assert pool.run(_facts, 2, args=("c",), timeout=60)[1]["sum"] == 3.0
    assert pool.stats["replaced"] == ["a rank raised, died or hung"] * 3


def test_a_function_the_ranks_cannot_import_is_an_error_of_each_rank(pool: RankPool) -> None:
    module = types.ModuleType("lockstep_pool_test_only_in_this_process")
    exec("def here_only():\n    return 1\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(DistributedTestError, match=r"(?s)\[rank 0/2\] raised:.*ModuleNotFoundError"):
            pool.run(module.here_only, 2, timeout=60)
    finally:
        del sys.modules[module.__name__]
    assert pool.run(_facts, 2, args=("after",), timeout=60)[0]["sum"] == 3.0


def _leave_a_mark(what: str) -> None:
    if what == "dtype":
        torch.set_default_dtype(torch.float64)
    elif what == "thread":
        threading.Thread(target=time.sleep, args=(600,), name="left-behind", daemon=True).start()
    elif what == "hang timeout":
        lockstep.init(hang_timeout=50)  # the group exists: only this process's setting changes
    elif what == "module constant":
        from lockstep.engine.deterministic import exact

        exact.BUCKET_ELEMENTS = 140_000  # as a test of deterministic mode does, for its model


@pytest.mark.parametrize(
    ("what", "why"),
    [
        ("dtype", "default dtype"),
        ("thread", "left-behind"),
        ("hang timeout", "_hang_timeout changed"),
        ("module constant", "lockstep.engine.deterministic.exact.BUCKET_ELEMENTS rebound"),
    ],
)
def test_a_worker_not_back_in_its_starting_state_is_replaced(pool: RankPool, what: str, why: str) -> None:
    before = [r["pid"] for r in pool.run(_facts, 2, args=("a",), timeout=60)]
    pool.run(_leave_a_mark, 2, args=(what,), timeout=60)  # the call itself succeeds
    [reason] = pool.stats["replaced"]
    assert why in reason, reason
    after = pool.run(_facts, 2, args=("b",), timeout=60)
    assert not set(before) & {r["pid"] for r in after} and after[0]["sum"] == 3.0


def _load_with_workers() -> list[float]:
    data = TensorDataset(torch.arange(8.0))
    return [float(x) for (batch,) in DataLoader(data, batch_size=4, num_workers=2) for x in batch]


def test_a_rank_may_start_processes_of_its_own(pool: RankPool) -> None:
    assert pool.run(_load_with_workers, 2, timeout=60) == [[float(i) for i in range(8)]] * 2


def test_run_distributed_goes_to_the_pool_in_use_when_it_can(pool: RankPool) -> None:
    previous = use_pool(pool)
    try:
        pooled = [r["pid"] for r in run_distributed(_facts, 2, args=("a",), timeout=60)]
        again = [r["pid"] for r in run_distributed(_facts, 2, args=("a",), timeout=60)]
        bigger = run_distributed(_facts, 4, args=("a",), timeout=60)  # more ranks than the pool: fresh ones
        with_env = run_distributed(_facts, 2, args=("a",), timeout=60, env={"LOCKSTEP_POOL_TEST": "1"})
    finally:
        use_pool(previous)
    assert pooled == again and pool.stats["calls"] == 2
    assert not {r["pid"] for r in bigger} & set(pooled) and [r["sum"] for r in bigger] == [10.0] * 4
    assert not {r["pid"] for r in with_env} & set(pooled) and with_env[0]["env"] == "1"
