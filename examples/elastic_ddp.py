"""The DDP tutorial's elastic_ddp.py: a torchrun-style script that reads LOCAL_RANK from the environment.

Run it either way, unchanged:
  lockstep run -n 2 examples/elastic_ddp.py
  torchrun --nproc-per-node 2 examples/elastic_ddp.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

from lockstep import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic():
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank} (local rank {local_rank}).")
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10, device=device))
    labels = torch.randn(20, 5, device=device)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


if __name__ == "__main__":
    demo_basic()
