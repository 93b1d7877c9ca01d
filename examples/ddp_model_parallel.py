"""The DDP tutorial's demo_model_parallel: each replica spans two devices (ToyMpModel).

Run: lockstep run -n 2 examples/ddp_model_parallel.py
With 2 GPUs per rank the halves sit on two GPUs; on a CPU-only machine both halves are on the CPU.
device_ids and output_device stay unset for a multi-device module, as in torch.
"""

import torch
import torch.nn as nn
import torch.optim as optim

import lockstep
from lockstep import DistributedDataParallel as DDP


class ToyMpModel(nn.Module):
    def __init__(self, dev0, dev1):
        super().__init__()
        self.dev0 = dev0
        self.dev1 = dev1
        self.net1 = torch.nn.Linear(10, 10).to(dev0)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5).to(dev1)

    def forward(self, x):
        x = x.to(self.dev0)
        x = self.relu(self.net1(x))
        x = x.to(self.dev1)
        return self.net2(x)


def pick_devices(rank):
    count = torch.cuda.device_count()
    if count >= 2 * (rank + 1):
        return torch.device("cuda", rank * 2), torch.device("cuda", rank * 2 + 1)
    if count >= 1:  # one GPU: split the replica across cpu and cuda
        return torch.device("cpu"), torch.device("cuda", rank % count)
    return torch.device("cpu"), torch.device("cpu")


def demo_model_parallel():
    topo = lockstep.init(backend="gloo")  # gloo: the replica may mix cpu and cuda tensors
    rank = topo.rank
    print(f"Running DDP with model parallel example on rank {rank}.")
    dev0, dev1 = pick_devices(rank)
    mp_model = ToyMpModel(dev0, dev1)
    ddp_mp_model = DDP(mp_model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_mp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_mp_model(torch.randn(20, 10))  # outputs will be on dev1
    labels = torch.randn(20, 5).to(dev1)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    print(f"rank {rank}: model-parallel step done on {dev0} and {dev1}")
    lockstep.shutdown()


if __name__ == "__main__":
    demo_model_parallel()
