"""A small data-parallel training program that goes wrong on one rank as its first argument says.

Run by tests/cli/test_hang_watchdog.py under `lockstep run` and without it. Every rank writes its pid to
OUT/pid-<rank>-<pid> first, so the test can check that no process is left. Each step takes ~0.15 s, so
the watchdog's heartbeats (every 0.4 s at a 4 s timeout) see the ranks move before one stops.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import lockstep
from lockstep.runtime import all_reduce_sum, broadcast_object

CASE, OUT = sys.argv[1], sys.argv[2]
CULPRIT, AT = 1, 4  # the rank that misbehaves, and at which step
# "sharded_<case>": the same case on a model cut by lockstep.shard (FSDP2): the others wait in its collectives
SHARDED = CASE.startswith("sharded_")
CASE = CASE.removeprefix("sharded_")


def stuck_in_user_code() -> None:
    time.sleep(600)


def deadlocked() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns: the main thread waits for itself


def spin_forever() -> None:
    n = 0
    while True:
        n += 1


def misbehave(rank: int, step: int) -> None:
    """What the culprit does at step AT, before its forward."""
    if rank != CULPRIT or step != AT:
        return
    if CASE == "user_sleep":
        stuck_in_user_code()
    elif CASE == "deadlock":
        deadlocked()
    elif CASE == "busy_loop":
        spin_forever()
    elif CASE == "sigstop":
        time.sleep(1.0)  # > 2 heartbeats at a 4 s timeout: the last one shows this step and function
        os.kill(os.getpid(), signal.SIGSTOP)
    elif CASE == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    elif CASE == "straggler":
        time.sleep(3)


def after_backward(rank: int, step: int) -> None:
    if step != AT:
        return
    if CASE == "shape_mismatch":
        all_reduce_sum([1.0] * (3 if rank == 0 else 2))
    elif CASE == "op_mismatch":
        if rank == 0:
            all_reduce_sum([1.0, 2.0])
        else:
            broadcast_object({"from": rank}, src=1)
    elif CASE == "untracked":  # a collective of the user's own, which lockstep does not number
        if rank == CULPRIT:
            stuck_in_user_code()
        torch.distributed.all_reduce(torch.ones(1))
    elif CASE == "slow_checkpoint":
        if rank == 0:
            with lockstep.phase("checkpoint"):  # what CheckpointManager.save does
                time.sleep(9)
        lockstep.barrier()


def custom_loop(rank: int) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if SHARDED:
        lockstep.shard(module)  # each Linear an FSDP unit: every forward all-gathers
        model: nn.Module = module
    else:
        model = lockstep.DistributedDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if CASE == "slow_first_step" and rank == CULPRIT:
        time.sleep(9)  # like a first step's compilation, longer than the timeout
    loss = torch.zeros(())
    for step in range(10):
        misbehave(rank, step)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        if not (CASE == "skip_backward" and rank == CULPRIT and step == AT):
            loss.backward()
        after_backward(rank, step)
        opt.step()
        opt.zero_grad()
        time.sleep(0.15)
    lockstep.all_reduce_mean(float(loss))


class SlowOnRankOne(Dataset):
    """A dataset whose loading never finishes on rank 1 from its 8th sample on (a stuck file system)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.loaded = rank, 0

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded += 1
        if self.rank == CULPRIT and self.loaded > 8:
            stuck_in_user_code()
        time.sleep(0.02)
        return torch.full((8,), float(i % 7)), torch.tensor([float(i % 3)])


def trainer_loop(rank: int) -> None:
    torch.manual_seed(0)
    config = lockstep.FitConfig(run_dir=os.path.join(OUT, "fit"), epochs=1, batch_size=4, progress="none")
    lockstep.fit(nn.Linear(8, 1), SlowOnRankOne(rank), loss_fn=nn.functional.mse_loss, config=config)


def main() -> None:
    topo = lockstep.init()
    open(os.path.join(OUT, f"pid-{topo.rank}-{os.getpid()}"), "w").close()
    if CASE == "data_loading":
        trainer_loop(topo.rank)
    else:
        custom_loop(topo.rank)
    print(f"rank {topo.rank} finished", flush=True)
    lockstep.shutdown()


if __name__ == "__main__":
    main()
