"""Shared pieces of the engine's multi-process tests: small models, per-rank data, three ways to train.

Every comparison trains the same initial weights on the same data three ways: lockstep's engine and
torch's DDP on N gloo ranks, and a single process on the concatenated N-rank batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep

BATCH = 4
IN, OUT = 8, 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class ManySmall(nn.Module):
    """Many tiny parameters: several buckets with a small cap, bulk copy-in buckets."""

    def __init__(self, depth: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(depth))
        self.head = nn.Linear(6, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class ConvBN(nn.Module):
    """BatchNorm: buffers that differ per rank after every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, 12)
        self.bn = nn.BatchNorm1d(12)
        self.head = nn.Linear(12, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "many_small": ManySmall, "convbn": ConvBN}


def batch(rank: int, step: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, IN, generator=gen), torch.randint(0, OUT, (size,), generator=gen)


def global_batch(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(r, step) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def wrap(kind: str, module: nn.Module, **kwargs: Any) -> tuple[nn.Module, Any]:
    """(callable model, handle-or-wrapper) for kind in ours / replicate / torch."""
    if kind == "torch":
        ddp = TorchDDP(module, **kwargs)
        return ddp, ddp
    if kind == "ours":
        ddp = lockstep.DistributedDataParallel(module, **kwargs)
        return ddp, ddp
    policy = lockstep.SyncPolicy(**{("bucket_cap_mb" if k == "bucket_cap_mb" else k): v for k, v in kwargs.items()})
    handle = lockstep.replicate(module, policy=policy)
    return module, handle


def train(
    kind: str, name: str, steps: int, *, kwargs: dict[str, Any] | None = None, no_sync_every: int = 0,
    lr: float = 0.1, rank_seeded: bool = True, configure: Callable[[nn.Module, int], None] | None = None,
) -> dict[str, Any]:
    """Train on this rank; return grads after each backward and params after the last step."""
    rank = dist.get_rank()
    module = build(name, seed=rank if rank_seeded else 0)  # different init per rank: the wrap must fix it
    if configure is not None:
        configure(module, rank)
    model, handle = wrap(kind, module, **(kwargs or {}))
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    grads = []
    for step in range(steps):
        x, y = batch(rank, step)
        sync = not no_sync_every or (step + 1) % no_sync_every == 0
        ctx = handle.no_sync() if not sync else _null()
        with ctx:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        if sync:
            grads.append(grads_of(module))
            opt.step()
            opt.zero_grad()
    buffers = [b.detach().clone() for b in module.buffers()]
    return {"grads": grads, "params": params_of(module), "buffers": buffers, "handle": None}


def train_single(name: str, world: int, steps: int, *, no_sync_every: int = 0, lr: float = 0.1) -> dict[str, Any]:
    """One process on the concatenated batch: the mean loss over world*BATCH samples."""
    module = build(name, seed=0)
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    grads = []
    for step in range(steps):
        x, y = global_batch(world, step)
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        if not no_sync_every or (step + 1) % no_sync_every == 0:
            grads.append(grads_of(module))
            opt.step()
            opt.zero_grad()
    return {"grads": grads, "params": params_of(module)}


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def assert_close_lists(a: list[Any], b: list[Any], *, atol: float = 1e-6, rtol: float = 1e-5, what: str = "") -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} tensors"
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}[{i}]: {x is None} vs {y is None} (None)"
            continue
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol, msg=lambda m, i=i: f"{what}[{i}]: {m}")


def copy_model(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


class WithUnused(nn.Module):
    """`spare` is never used in forward; `extra` only when `use_extra` is set (per rank if wanted)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, 16)
        self.extra = nn.Linear(16, 16)
        self.spare = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if self.use_extra:
            h = torch.relu(self.extra(h))
        return self.head(h)


class Tied(nn.Module):
    """Weight tying: the embedding matrix is also the output projection (used twice per forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(IN, 16, bias=False)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, IN, bias=False)
        self.out.weight = nn.Parameter(self.emb.weight.detach().t().contiguous())
        self.proj = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.emb(x)))
        h = torch.tanh(self.mid(h))  # `mid` used twice as well
        return self.proj(self.out(h))


class Checkpointed(nn.Module):
    """Activation checkpointing around the middle blocks (reentrant or not)."""

    def __init__(self, reentrant: bool = True, shared: bool = False) -> None:
        super().__init__()
        self.order = [0, 1, 0] if shared else [0, 1, 2]  # shared: block 0 runs in two checkpoints
        self.inp = nn.Linear(IN, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, OUT)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for i in self.order:
            h = checkpoint(self.blocks[i], h, use_reentrant=self.reentrant)
        return self.head(h)


class ToyMpModel(nn.Module):
    """The tutorials' DDP + model parallel model; both halves on cpu in CI."""

    def __init__(self, dev0: str = "cpu", dev1: str = "cpu") -> None:
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.net1 = nn.Linear(IN, 10).to(dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, OUT).to(dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1)).cpu()


MODELS.update({
    "unused": WithUnused, "tied": Tied, "ckpt_reentrant": lambda: Checkpointed(True),
    "ckpt_plain": lambda: Checkpointed(False), "toymp": ToyMpModel,
    "ckpt_shared": lambda: Checkpointed(True, shared=True),
})
