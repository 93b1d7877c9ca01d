"""Shared pieces of the engine's multi-process tests: small models and per-rank data.

The three-way training itself (lockstep's engine and torch's DDP on N gloo ranks, one process on the
concatenated N-rank batch) is lockstep.testing.parity; `case` builds its cases from the models here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lockstep.testing.parity import ParityCase, assert_tensors_close, grads_of, params_of, wrap

__all__ = [
    "BATCH",
    "IN",
    "MODELS",
    "OUT",
    "MLP",
    "ParityCase",
    "WithUnused",
    "assert_close_lists",
    "batch",
    "build",
    "case",
    "grads_of",
    "params_of",
    "wrap",
]

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


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def case(name: str, steps: int, **fields: Any) -> ParityCase:
    """A lockstep.testing.parity case on one of MODELS and this module's per-rank batches."""
    return ParityCase(model=functools.partial(build, name), data=batch, steps=steps, **fields)


def assert_close_lists(
    a: list[Any], b: list[Any], *, atol: float = 1e-6, rtol: float = 1e-5, what: str = ""
) -> None:
    assert_tensors_close(a, b, atol, rtol, what=what)


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

    def __init__(self, reentrant: bool = True, shared: bool = False, blocks: int = 3) -> None:
        super().__init__()
        self.order = [0, 1, 0] if shared else [0, 1, 2]  # shared: block 0 runs in two checkpoints
        self.inp = nn.Linear(IN, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks))
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


MODELS.update(
    {
        "unused": WithUnused,
        "tied": Tied,
        "ckpt_reentrant": lambda: Checkpointed(True),
        "ckpt_plain": lambda: Checkpointed(False),
        "toymp": ToyMpModel,
        "ckpt_shared": lambda: Checkpointed(True, shared=True),  # block 2 unused
        "ckpt_twice": lambda: Checkpointed(True, shared=True, blocks=2),  # every parameter used
    }
)
