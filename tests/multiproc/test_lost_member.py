"""runtime/membership/recovery.py's `is_lost_member` on real gloo: a dead peer is a lost member wherever the
collective was issued (torch.distributed called by the program, lockstep's own collectives, lockstep's
engine waiting on a bucket); the program's own RuntimeError, raised in its code or in torch outside
torch.distributed, is not, though its type is the same as gloo's.

Member 1 forms a 2-process gloo group with member 0 and exits; member 0 then meets the dead peer in each
kind of collective, and raises RuntimeErrors of its own, and reports how each was classified.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine import replicate
from lockstep.runtime.collectives import all_reduce_mean
from lockstep.runtime.membership.recovery import is_lost_member
from tests.helpers import start_members

GONE = "test/member1-gone"


def _classified(work: Any) -> str:
    try:
        work()
    except Exception as exc:  # noqa: BLE001  what the test asserts on
        return f"{type(exc).__name__} lost={is_lost_member(exc)}: {str(exc)[:200]}"
    return "no error"


def _program_check(loss: torch.Tensor) -> None:
    if loss.isnan():
        raise RuntimeError("loss is NaN")  # the program's own check, with gloo's exception type


def _member(port: int, member: int, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCKSTEP_HANG_TIMEOUT"] = "0"  # no watchdog report of the failed collectives: as in live mode
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=member, world_size=2, timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    replicate(model)  # collectives at wrap time, with the peer alive
    dist.barrier()
    if member == 1:
        store.set(GONE, "1")
        os._exit(0)  # the peer dies, its sockets close
    store.wait([GONE])

    def engine_backward() -> None:
        model(torch.randn(3, 4)).sum().backward()  # the engine's bucket all-reduce meets the dead peer

    results.put({
        "program's own check": _classified(lambda: _program_check(torch.tensor(float("nan")))),
        "torch op in the program": _classified(lambda: torch.ones(2, 3) @ torch.ones(2, 3)),
        "torch.distributed": _classified(lambda: dist.all_reduce(torch.ones(1))),
        "lockstep collective": _classified(lambda: all_reduce_mean([1.0])),
        "engine's backward": _classified(engine_backward),
    })  # fmt: skip
    results.close()
    results.join_thread()  # flushed before the hard exit
    os._exit(0)  # the group cannot be destroyed cleanly without its peer


@pytest.mark.timeout(90)
def test_a_dead_peer_is_a_lost_member_wherever_and_the_programs_own_runtime_error_is_not() -> None:
    _store, procs, results = start_members(_member, (0, 1))
    got = results.get(timeout=75)
    for proc in procs:
        proc.join(timeout=30)
    assert got["program's own check"] == "RuntimeError lost=False: loss is NaN", got
    assert got["torch op in the program"].startswith("RuntimeError lost=False: mat1 and mat2 shapes"), got
    for where in ("torch.distributed", "lockstep collective", "engine's backward"):
        kind, lost = got[where].split(":")[0].split()
        assert kind in ("RuntimeError", "DistBackendError", "DistNetworkError") and lost == "lost=True", got
