"""The built-in jobs' models: the tutorials' ToyModel and SimpleNet, a digit MLP, a small ResNet, a tiny GPT."""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn


class ToyModel(nn.Module):
    """The DDP tutorial's ToyModel: Linear(10, 10) -> ReLU -> Linear(10, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class SimpleNet(nn.Module):
    """The MNIST tutorial's SimpleNet: 28x28 -> 256 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(28 * 28, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.view(-1, 28 * 28))))


class DigitsNet(nn.Module):
    """A small MLP for scikit-learn's 8x8 digits."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _Block(nn.Module):
    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.skip = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class SmallResNet(nn.Module):
    """A ResNet-style CNN with BatchNorm for 32x32 images."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(
            _Block(width, width, 1), _Block(width, 2 * width, 2), _Block(2 * width, 4 * width, 2)
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.layers(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).unbind(dim=2)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class _GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def residual_projections(self) -> list[nn.Linear]:
        """The linears whose outputs are added into the residual stream."""
        contract = cast(nn.Linear, self.mlp[2])  # Sequential(Linear, GELU, Linear): the second linear
        return [self.attn.proj, contract]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


INIT_STD = 0.02  # GPT-2's initialisation: weights N(0, 0.02), biases zero


class TinyGPT(nn.Module):
    """A character-level GPT: token + position embeddings, causal blocks, a head tied to the embedding.

    Initialised as GPT-2: linear and embedding weights N(0, 0.02), biases zero, the projections that add
    into the residual stream (attention's proj, the MLP's second linear) scaled by 1 / sqrt(2 depth).
    torch's defaults (the embedding N(0, 1), tied to the head) give logits of std about sqrt(dim) and a
    first loss ten times a uniform guess's; with these the untrained model's loss is about ln(vocab)."""

    def __init__(
        self, vocab_size: int, *, context: int = 64, dim: int = 64, depth: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.Sequential(*[_GPTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.token.weight  # tied weights: one parameter used twice
        self._init_weights(depth)

    def _init_weights(self, depth: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.position, std=INIT_STD)
        for block in self.blocks.children():  # the residual projections: 2 depth adds keep the scale
            for residual in cast(_GPTBlock, block).residual_projections():
                nn.init.normal_(residual.weight, std=INIT_STD / math.sqrt(2 * depth))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))
