"""The DDP series' multi-GPU Trainer with snapshots (multigpu_torchrun.py), on lockstep; resumable.

Run: lockstep run -n 2 examples/multigpu_trainer.py [total_epochs] [save_every] [--batch-size N] [--snapshot PATH]
Defaults are the tutorial's `50 10`. Kill it and start it again: it resumes from the last snapshot.
Under `lockstep run --max-restarts 2` a crashed rank restarts the job, which resumes the same way.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lockstep
from lockstep import DistributedDataParallel as DDP
from lockstep.data import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        generator = torch.Generator().manual_seed(0)  # the same data on every rank
        self.data = [
            (torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)
        ]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.global_rank = int(os.environ.get("RANK", 0))
        use_cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", self.local_rank) if use_cuda else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print(f"[rank {self.global_rank}] Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.local_rank] if use_cuda else None)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.global_rank}] Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            loss = self._run_batch(source.to(self.device), targets.to(self.device))
        if self.global_rank == 0 and (epoch % 10 == 0 or epoch == self.total_epochs - 1):
            print(
                f"[rank 0] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)} | loss {loss.item():.4f}"
            )

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        # Write then rename, so that a crash mid-write never leaves a damaged snapshot. Native lockstep:
        # lockstep.checkpoint.CheckpointManager does this (plus RNG and sampler state) for every rank.
        tmp_path = f"{self.snapshot_path}.tmp"
        torch.save(snapshot, tmp_path)
        os.replace(tmp_path, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        self.total_epochs = max_epochs
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def main(args):
    lockstep.init()
    dataset = MyTrainDataset(args.dataset_size)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = DataLoader(
        dataset,
        batch_size=args.batch_size,
        pin_memory=False,
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot)
    trainer.train(args.total_epochs)
    lockstep.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument(
        "total_epochs", type=int, nargs="?", default=50, help="Total epochs to train the model"
    )
    parser.add_argument("save_every", type=int, nargs="?", default=10, help="How often to save a snapshot")
    parser.add_argument("--batch-size", type=int, default=32, help="Input batch size on each device")
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument("--snapshot", default="snapshot.pt", help="where the snapshot lives")
    main(parser.parse_args())
