"""The DDP tutorial's demo_basic: ToyModel, one training step, on lockstep.

Run: lockstep run -n 2 examples/ddp_basic.py   (or torchrun --nproc-per-node 2, or plain python for 1 rank)
Only the imports differ from the tutorial; the device falls back to CPU without GPUs.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

from lockstep import DistributedDataParallel as DDP  # was: from torch.nn.parallel import ...


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic():
    # Native lockstep: `topo = lockstep.init()` picks gloo or nccl, binds the device, and also works
    # under plain `python` as a world of 1. The tutorial's call works as it is:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    device = (
        torch.device("cuda", rank % torch.cuda.device_count())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10, device=device))
    labels = torch.randn(20, 5, device=device)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    checksum = sum(p.detach().double().sum() for p in ddp_model.parameters())
    print(f"rank {rank}: step done, parameter checksum {float(checksum):.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    demo_basic()
