"""The MNIST tutorial: SimpleNet with DistributedSampler and set_epoch, on lockstep.

Run: lockstep run -n 2 examples/mnist_ddp.py [--data DIR] [--epochs N]
Reads MNIST-format IDX files from --data (default: Debian's Fashion-MNIST in /usr/share/datasets/fashion-mnist/);
when none are there it falls back to scikit-learn's bundled 8x8 digits, upscaled to 28x28, so it runs anywhere.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, Subset, TensorDataset

import lockstep
from lockstep import DistributedDataParallel as DDP  # was: torch.nn.parallel.DistributedDataParallel
from lockstep.data import (
    DistributedSampler,  # was: torch.utils.data.DistributedSampler
    EvalSampler,
    reduce_eval,
)


class SimpleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = x.view(-1, 28 * 28)
        x = torch.relu(self.fc1(x))
        return self.fc2(x)


def load_data(data_dir, max_train):
    from lockstep.jobs import datasets

    if os.path.isdir(data_dir) and any(name.startswith("train-images") for name in os.listdir(data_dir)):
        train, test = datasets.mnist(data_dir)
        source = f"MNIST-format files in {data_dir}"
    else:
        train, test = datasets.digits()
        train, test = (
            TensorDataset(nn.functional.interpolate(d.tensors[0].view(-1, 1, 8, 8), size=28), d.tensors[1])
            for d in (train, test)
        )
        source = "scikit-learn digits (no MNIST files found)"
    if max_train and len(train) > max_train:
        train = Subset(train, range(max_train))
    return train, test, source


def train(args):
    lockstep.init()  # native; the tutorial's dist.init_process_group(...) works too
    rank = dist.get_rank()
    device = (
        torch.device("cuda", rank % torch.cuda.device_count())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    train_dataset, test_dataset, source = load_data(args.data, args.max_train)
    if rank == 0:
        print(f"data: {source}, {len(train_dataset)} training samples")
    sampler = DistributedSampler(train_dataset)  # Distributed data sampling
    train_loader = DataLoader(train_dataset, batch_size=64, sampler=sampler)

    model = SimpleNet().to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # as in the tutorial; without it every epoch repeats epoch 0's order
        model.train()
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = criterion(model(data), target)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"Epoch {epoch}, Loss: {loss.item():.4f}")

    # Exact test accuracy: every test sample on exactly one rank, no padded duplicates (torch's sampler pads).
    test_loader = DataLoader(test_dataset, batch_size=256, sampler=EvalSampler(test_dataset))
    correct = 0
    model.eval()
    with torch.no_grad():
        for data, target in test_loader:
            # The bare module: ranks hold unequal shards, so nothing here may wait for the others.
            correct += int((model.module(data.to(device)).argmax(dim=1) == target.to(device)).sum())
    totals = reduce_eval({"correct": correct, "total": len(test_loader.sampler)})
    if rank == 0:
        print(f"test accuracy {totals['correct'] / totals['total']:.4f} on {totals['total']} samples")
    lockstep.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist/")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--max-train", type=int, default=6000, help="cap the training set (0 = all) to stay quick on CPU"
    )
    train(parser.parse_args())
