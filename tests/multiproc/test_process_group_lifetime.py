"""`with lockstep.init():` leaves the process group on exit only where that init() call formed it (issue 15).

On real gloo ranks: a group the caller formed (with lockstep.init() or torch's init_process_group) survives
a `with lockstep.init():` in library code and still reduces afterwards; a group the `with` formed is gone
at its exit; a handle from a group since left and formed again does not touch the new one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch.distributed as dist

import lockstep
from lockstep.runtime import all_reduce_sum
from lockstep.testing import run_distributed
from tests.helpers import free_port

_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _clean_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")
    }


def _run_ranks(code: str, world_size: int = 2, timeout: float = 90) -> list[list[str]]:
    """Run `code` as `python -c` on `world_size` ranks (torchrun's variables, no agent); each rank's stdout
    lines, by rank. Every rank must exit 0."""
    clean = _clean_env()
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = {
            **clean,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(code)],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err}"
            outputs.append(out.split("\n"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [[line for line in lines if line] for lines in outputs]


def _with_inside_a_lockstep_group() -> tuple[list[float], int, int, bool, list[float]]:
    # The harness formed the group with lockstep.init(); this is library code that also writes `with`.
    rank = dist.get_rank()
    with lockstep.init() as topo:
        inside = all_reduce_sum([rank + 1.0])
    alive = dist.is_initialized()
    after = all_reduce_sum([10.0 * (rank + 1)])  # without a group this would be this rank's own value
    return inside, topo.rank, topo.world_size, alive, after


def test_with_leaves_a_group_formed_by_the_callers_init_alone() -> None:
    out = run_distributed(_with_inside_a_lockstep_group, 2, timeout=60)
    assert out == [([3.0], 0, 2, True, [30.0]), ([3.0], 1, 2, True, [30.0])]


def test_with_leaves_a_group_formed_by_init_process_group_alone() -> None:
    # lockstep's names load at first use, so lockstep.init() imports lockstep.runtime after the group exists;
    # each rank also checks that no default argument then holds the group (which made an exit abort with
    # "terminate called without an active exception" in about 1 run of 7).
    code = """
        import torch, torch.distributed as dist, lockstep
        dist.init_process_group("gloo")  # the caller's own group (env://)
        with lockstep.init() as topo:
            inside = torch.tensor([topo.rank + 1.0])
            dist.all_reduce(inside)
        alive = dist.is_initialized()
        after = torch.tensor([10.0 * (dist.get_rank() + 1)])
        dist.all_reduce(after)
        def pinned():  # a function: no global of this program may hold the group itself at exit either
            import torch.distributed.nn.functional as fn  # imported (by lockstep or torch) after the group
            world = dist.group.WORLD
            return [n for n, f in vars(fn).items() if any(d is world for d in getattr(f, "__defaults__", None) or ())]
        print(topo.rank, topo.world_size, inside.item(), alive, after.item(), pinned())
        dist.destroy_process_group()
    """
    assert _run_ranks(code) == [["0 2 3.0 True 30.0 []"], ["1 2 3.0 True 30.0 []"]]


def test_a_group_formed_by_the_with_is_left_at_its_exit() -> None:
    code = """
        import torch, torch.distributed as dist, lockstep
        print("before", dist.is_initialized())
        with lockstep.init() as topo:
            again = lockstep.init()
            with lockstep.init():  # a nested `with` joins the group: it leaves it alone
                pass
            with topo:  # the name bound by `as` does not own the group either
                pass
            total = torch.tensor([topo.rank + 1.0])
            dist.all_reduce(total)
            print("inside", dist.is_initialized(), again is topo, again == topo, total.item())
        print("after", dist.is_initialized())
    """
    expected = ["before False", "inside True True True 3.0", "after False"]
    assert _run_ranks(code) == [expected, expected]


def test_a_with_over_a_group_since_left_leaves_the_new_group_alone() -> None:
    code = """
        import torch.distributed as dist, lockstep
        first = lockstep.init()
        lockstep.shutdown()
        second = lockstep.init()
        with first:  # formed the group that was left: not this one
            pass
        print("stale", dist.is_initialized(), first == second)
        with second:
            pass
        print("owner", dist.is_initialized())
    """
    # A world of 1 from plain `python` (an in-memory store): the group is formed twice in one process.
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_clean_env(),
        text=True,
        capture_output=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["stale True True", "owner False"]
