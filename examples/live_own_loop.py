"""A training loop of your own that keeps going when a rank dies: lockstep.LiveLoop.

Run it in live mode: 4 processes, the job goes on while at least 2 remain, and each lost rank is
replaced (up to 2 times) by a new process that heals from a peer:

  lockstep run -n 4 --min-world 2 --max-restarts 2 examples/live_own_loop.py

Kill one of its workers meanwhile (kill -9 on a pid from runs/.../rank*/pid, or Ctrl-Z one): the
others redo the step they were in over the survivors and carry on, in the same processes. The
parameters at the end are bitwise those of a run without faults, at any world size; compare the
`params_sha256` line of two runs. Without --min-world (plain `lockstep run`, or torchrun) the same
program trains as usual. With --no-deterministic the engine sums the gradients in float with its buckets
(faster; the end equals a fault-free run's up to rounding).

What LiveLoop needs from your program: the model, the optimizer, a MicroBatchSampler (each step's
samples, fixed at any world size), the objects whose state a replacement must receive (here the
learning-rate scheduler), and the forward and backward of one micro-batch.
"""

import argparse
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.checkpoint import state_sha256
from lockstep.data import MicroBatchSampler


def make_data(num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed synthetic task, the same in every process: 8 classes from a random linear teacher."""
    gen = torch.Generator().manual_seed(1234)
    inputs = torch.randn(num_samples, 32, generator=gen)
    teacher = torch.randn(32, 8, generator=gen)
    return inputs, (inputs @ teacher).argmax(dim=1)


def evaluate(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Accuracy over every sample, each rank taking its share of the current group (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()  # no dropout
    with torch.no_grad():
        mine = torch.arange(rank, len(inputs), world)
        correct = (model(inputs[mine]).argmax(dim=1) == targets[mine]).sum().double().reshape(1)
    model.train()
    dist.all_reduce(correct)
    return float(correct.item()) / len(inputs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8, help="per step: the global batch is 8 x 8")
    parser.add_argument(
        "--no-deterministic", action="store_true", help="float sums: faster, the same result up to rounding"
    )
    parser.add_argument("--summary", default=None, help="rank 0 writes the end state here (JSON)")
    args = parser.parse_args()

    lockstep.init()  # in live mode this also joins the live group (or queues a replacement)
    inputs, targets = make_data(args.samples)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    sampler = MicroBatchSampler(
        range(args.samples), micro_batch_size=args.micro_batch_size, num_micro_batches=args.micro_batches
    )
    loop = lockstep.LiveLoop(
        model, optimizer, sampler, state={"scheduler": scheduler}, deterministic=not args.no_deterministic
    )

    def micro_step(indices: list[int]) -> float:
        loss = F.cross_entropy(model(inputs[indices]), targets[indices])
        loss.backward()
        return float(loss.detach())

    accuracy = 0.0
    for epoch in range(loop.epoch, args.epochs):
        for losses in loop.train_epoch(epoch, micro_step):
            scheduler.step()
            if loop.step % 10 == 0 and dist.get_rank() == 0:
                mean = sum(losses.values()) / len(losses)
                print(
                    f"step {loop.step} epoch {epoch} world {dist.get_world_size()} loss {mean:.4f}",
                    flush=True,
                )
        with lockstep.phase(
            "evaluate"
        ):  # its time is the run's evaluation, not training (lockstep.goodput())
            accuracy = loop.retry(lambda: evaluate(model, inputs, targets))  # redone if a rank dies in it
        if dist.get_rank() == 0:
            print(f"epoch {epoch} accuracy {accuracy:.4f}", flush=True)

    if dist.get_rank() == 0:
        summary = {
            "steps": loop.step,
            "world_size": dist.get_world_size(),
            "params_sha256": state_sha256(model.state_dict()),
            "optimizer_sha256": state_sha256(optimizer.state_dict()["state"]),
            "faults": loop.faults,
            "accuracy": accuracy,
            **lockstep.goodput(),  # the time of the counted steps over the run's, and where the rest went
        }
        print(f"params_sha256 {summary['params_sha256']}", flush=True)
        if args.summary:
            with open(args.summary, "w") as fh:
                json.dump(summary, fh, indent=1)
    loop.retry(dist.barrier)
    lockstep.shutdown()


if __name__ == "__main__":
    sys.exit(main())
