"""The DDP tutorial's demo_checkpoint: rank 0 saves, a barrier, every rank loads, one step.

Run: lockstep run -n 2 examples/ddp_checkpoint.py
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

import lockstep
from lockstep import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_checkpoint():
    topo = lockstep.init()
    rank = topo.rank
    print(f"Running DDP checkpoint example on rank {rank}.")
    device = torch.device("cuda", topo.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    # One path for the whole job (the tutorial's tempfile path differs per user on a shared machine).
    checkpoint_dir = lockstep.broadcast_object(tempfile.mkdtemp() if rank == 0 else None)
    checkpoint_path = os.path.join(checkpoint_dir, "model.checkpoint")
    if rank == 0:
        torch.save(ddp_model.state_dict(), checkpoint_path)
    dist.barrier()  # nobody loads before rank 0 has saved
    # The tutorial maps cuda:0 to this rank's device; weights_only keeps the load safe.
    ddp_model.load_state_dict(torch.load(checkpoint_path, map_location=device, weights_only=True))
    # Native lockstep does all of the above in one call, atomically, rank 0 writing and the others waiting:
    #   manager = lockstep.checkpoint.CheckpointManager(run_dir, keep=3)
    #   manager.save(step, {"model": ddp_model, "optimizer": optimizer}); manager.load({...})

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10, device=device))
    labels = torch.randn(20, 5, device=device)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    if rank == 0:
        os.remove(checkpoint_path)
        os.rmdir(checkpoint_dir)
    print(f"rank {rank}: checkpoint saved, loaded and trained from")
    lockstep.shutdown()


if __name__ == "__main__":
    demo_checkpoint()
