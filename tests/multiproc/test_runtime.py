"""Runtime on real gloo ranks: init, collectives, JSON objects, main_process_first, and the harness itself."""

from __future__ import annotations

import os
import time
from pathlib import Path

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
    assert run_distributed(_whoami, 3, timeout=60) == [
        (0, 3, True, "gloo"),
        (1, 3, False, "gloo"),
        (2, 3, False, "gloo"),
    ]


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


def _ordered_entries(directory: str) -> dict[str, object]:
    """Evidence of the order, without sleeps: files written just before and inside the block.

    Every other rank announces that it reached main_process_first (`arrived-r`) and only then enters.
    Rank 0, inside the block, waits until all of them have arrived, and only then leaves, writing `done-0`
    last. A correct implementation holds the others until then, so they find `done-0` on entry. With a
    no-op they enter right after announcing, while rank 0 is still polling for their arrival (every 50 ms):
    they find it missing, and rank 0's line is not the first of order.txt.
    """
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    base = Path(directory)
    seen_before = (base / "done-0").exists()  # rank 0 cannot have left the block: it waits for this rank
    if rank != 0:
        (base / f"arrived-{rank}").touch()
    with main_process_first():
        done_on_entry = (base / "done-0").exists()
        with open(base / "order.txt", "a") as handle:
            handle.write(f"{rank}\n")
        if rank == 0:
            deadline = time.monotonic() + 30
            while not all((base / f"arrived-{r}").exists() for r in range(1, world)):
                if time.monotonic() > deadline:
                    raise TimeoutError("the other ranks never reached main_process_first")
                time.sleep(0.05)  # polling pace only: correctness rests on the files
            (base / "done-0").touch()
    lockstep.barrier()
    return {
        "seen_before": seen_before,
        "done_on_entry": done_on_entry,
        "order": (base / "order.txt").read_text().split(),
    }


def test_main_process_first_runs_rank0_before_the_others(tmp_path: Path) -> None:
    out = run_distributed(_ordered_entries, 3, args=(str(tmp_path),), timeout=60)
    for rank, result in enumerate(out):
        assert result["seen_before"] is False, f"rank {rank} saw rank 0 finish before it arrived"
        if rank != 0:
            assert result["done_on_entry"] is True, f"rank {rank} entered before rank 0 had left the block"
        assert result["order"][0] == "0" and sorted(result["order"]) == ["0", "1", "2"], result


def _raise_on_rank1() -> None:
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom from the test")


@pytest.mark.fresh_ranks  # run_distributed's own processes: the harness is what is tested
def test_harness_names_the_failing_rank() -> None:
    with pytest.raises(
        DistributedTestError, match=r"\[rank 1/2\] raised:(.|\n)*ValueError: boom from the test"
    ):
        run_distributed(_raise_on_rank1, 2, timeout=60)


def _hang_on_rank0(pid_file: str) -> None:
    with open(f"{pid_file}.{torch.distributed.get_rank()}", "w") as handle:
        handle.write(str(os.getpid()))
    if torch.distributed.get_rank() == 0:
        time.sleep(600)


@pytest.mark.fresh_ranks
def test_harness_kills_a_hung_rank_within_the_timeout(tmp_path) -> None:
    # (How soon after the 15 s the call fails: benchmarks/failure_latency.py, case harness-hang.)
    with pytest.raises(DistributedTestError, match=r"\[rank 0/2\] did not finish within 15 s"):
        run_distributed(_hang_on_rank0, 2, args=(str(tmp_path / "pid"),), timeout=15)
    pid = int((tmp_path / "pid.0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _exit_hard() -> None:
    if torch.distributed.get_rank() == 1:
        os._exit(7)


@pytest.mark.fresh_ranks
def test_harness_reports_a_rank_that_dies() -> None:
    with pytest.raises(DistributedTestError, match=r"\[rank 1/2\] exited with code 7"):
        run_distributed(_exit_hard, 2, timeout=60)


@pytest.mark.fresh_ranks
def test_concurrent_harness_runs_do_not_collide() -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_distributed, _whoami, 2, timeout=90) for _ in range(2)]
        assert [f.result()[1][0] for f in futures] == [1, 1]


def _send_state() -> dict[str, object]:
    from lockstep.runtime.state_transfer import broadcast_state

    rank = torch.distributed.get_rank()
    model = torch.nn.Linear(5, 3)
    torch.manual_seed(rank)  # every rank's own values: only rank 1's may arrive
    model.reset_parameters()
    tree = {"model": model.state_dict(), "step": 10 + rank, "ids": (rank, "r")} if rank == 1 else None
    got = broadcast_state(tree, src=1)
    return {
        "step": got["step"],
        "ids": got["ids"],
        "weight": got["model"]["weight"].tolist(),
        "mine": model.weight.tolist() if rank == 1 else None,
    }


def test_broadcast_state_sends_the_source_rank_state_to_all() -> None:
    out = run_distributed(_send_state, 3, timeout=60)
    source = out[1]["mine"]
    assert [o["step"] for o in out] == [11, 11, 11]
    assert [o["ids"] for o in out] == [(1, "r")] * 3
    assert all(o["weight"] == source for o in out)
