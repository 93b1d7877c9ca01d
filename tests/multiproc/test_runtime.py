"""Runtime on real gloo ranks: init, collectives, JSON objects, main_process_first, and the harness itself."""

from __future__ import annotations

import os
import time

import pytest
import torch

import lockstep
from lockstep.errors import DistributedTestError
from lockstep.runtime import all_gather_object, all_reduce_mean, broadcast_object, main_process_first
from lockstep.testing import run_distributed


def _whoami() -> tuple[int, int, bool, str]:
    topo = lockstep.init()  # idempotent: the harness already initialised
    return topo.rank, topo.world_size, lockstep.is_main(), torch.distributed.get_backend()


def test_init_gives_each_rank_its_place() -> None:
    assert run_distributed(_whoami, 3, timeout=60) == [(0, 3, True, "gloo"), (1, 3, False, "gloo"), (2, 3, False, "gloo")]


def _collectives() -> tuple[float, list[float], object, list[object]]:
    rank = torch.distributed.get_rank()
    mean = all_reduce_mean(float(rank))
    packed = all_reduce_mean([rank, 10.0 * rank])
    obj = broadcast_object({"from": rank, "nested": [1, "two"]} if rank == 1 else None, src=1)
    gathered = all_gather_object({"rank": rank, "pad": "x" * rank * 3})
    return mean, packed, obj, gathered


def test_collectives_agree() -> None:
    out = run_distributed(_collectives, 3, timeout=60)
    for mean, packed, obj, gathered in out:
        assert mean == pytest.approx(1.0)
        assert packed == pytest.approx([1.0, 10.0])
        assert obj == {"from": 1, "nested": [1, "two"]}
        assert gathered == [{"rank": r, "pad": "x" * r * 3} for r in range(3)]


def _ordered_writes(path: str) -> list[str]:
    with main_process_first():
        with open(path, "a") as handle:
            handle.write(f"{torch.distributed.get_rank()}\n")
        time.sleep(0.2 if lockstep.is_main() else 0)
    lockstep.barrier()
    with open(path) as handle:
        return handle.read().split()


def test_main_process_first_runs_rank0_before_the_others(tmp_path) -> None:
    out = run_distributed(_ordered_writes, 3, args=(str(tmp_path / "order.txt"),), timeout=60)
    assert all(lines[0] == "0" and sorted(lines) == ["0", "1", "2"] for lines in out)


def _raise_on_rank1() -> None:
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom from the test")


def test_harness_names_the_failing_rank() -> None:
    with pytest.raises(DistributedTestError, match=r"\[rank 1/2\] raised:(.|\n)*ValueError: boom from the test"):
        run_distributed(_raise_on_rank1, 2, timeout=60)


def _hang_on_rank0(pid_file: str) -> None:
    with open(f"{pid_file}.{torch.distributed.get_rank()}", "w") as handle:
        handle.write(str(os.getpid()))
    if torch.distributed.get_rank() == 0:
        time.sleep(600)


def test_harness_kills_a_hung_rank_within_the_timeout(tmp_path) -> None:
    started = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"\[rank 0/2\] did not finish within 15 s"):
        run_distributed(_hang_on_rank0, 2, args=(str(tmp_path / "pid"),), timeout=15)
    assert time.monotonic() - started < 30
    pid = int((tmp_path / "pid.0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _exit_hard() -> None:
    if torch.distributed.get_rank() == 1:
        os._exit(7)


def test_harness_reports_a_rank_that_dies() -> None:
    with pytest.raises(DistributedTestError, match=r"\[rank 1/2\] exited with code 7"):
        run_distributed(_exit_hard, 2, timeout=60)


def test_concurrent_harness_runs_do_not_collide() -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_distributed, _whoami, 2, timeout=90) for _ in range(2)]
        assert [f.result()[1][0] for f in futures] == [1, 1]
