"""A tiny deterministic data-parallel training run for the multi-node and SLURM tests (run as a script).

Every step draws the same global batch (seeded by the step) whatever the world size; rank r trains on rows
r::world of it with lockstep.DistributedDataParallel, so the parameters after N steps depend only on N
(bitwise for one world size, to float rounding across world sizes). Rank 0 prints one line:

    RESULT world=2 steps=30 resumed_from=0 sum=<float> sha=<sha256 of the parameters' bytes>

--ckpt-dir: resume from the newest checkpoint there (lockstep.checkpoint) and save every --ckpt-every
steps. SIGUSR1 (what `lockstep slurm --requeue` forwards before the time limit): all ranks agree at the
next step boundary, save a checkpoint, print CHECKPOINTED and exit 0. --progress FILE: rank 0 writes the
step it reached (the test waits on it before signalling). --sleep: seconds per step, to make a run last.
--explicit: read RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and pass rank/world_size to lockstep.init().
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import torch

import lockstep

GLOBAL_BATCH = 12


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    return x[rank::world], y[rank::world]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--ckpt-every", type=int, default=5)
    parser.add_argument("--progress", default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--explicit", action="store_true")
    args = parser.parse_args()

    stop_requested = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: stop_requested.append(signum))
    if args.explicit:
        topo = lockstep.init(
            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=60
        )
    else:
        topo = lockstep.init(timeout=60)
    rank, world = topo.rank, topo.world_size
    print(
        f"rank {rank}/{world} local {topo.local_rank}/{topo.local_world_size} node {topo.node_rank}/"
        f"{topo.num_nodes} via {topo.launcher} endpoint {topo.endpoint}",
        flush=True,
    )
    model = build_model()
    ddp = lockstep.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optimizer": opt}
    manager = None
    start = 0
    if args.ckpt_dir:
        from lockstep.checkpoint import CheckpointManager

        manager = CheckpointManager(args.ckpt_dir, keep=2)
        start = manager.load(state) or 0
    for step in range(start, args.steps):
        flag = torch.tensor([1.0 if stop_requested else 0.0])
        if world > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() > 0 and manager is not None:
            manager.save(step, state)
            if rank == 0:
                print(f"CHECKPOINTED step={step}", flush=True)
            lockstep.shutdown()
            return 0
        x, y = batch(step, rank, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        done = step + 1
        if manager is not None and done % args.ckpt_every == 0:
            manager.save(done, state)
        if rank == 0 and args.progress:
            with open(args.progress, "w") as fh:
                fh.write(f"{done}\n")
        if args.sleep:
            time.sleep(args.sleep)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    if rank == 0:
        sha = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        print(
            f"RESULT world={world} steps={args.steps} resumed_from={start} sum={flat.sum().item()!r} sha={sha}",
            flush=True,
        )
    lockstep.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
