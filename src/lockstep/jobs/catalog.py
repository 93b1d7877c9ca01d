"""The built-in jobs of `lockstep train`: each is a config dataclass plus a function that builds the run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep.errors import ConfigError
from lockstep.jobs import datasets, models
from lockstep.trainer.config import Bound, FitConfig, at_least


@dataclass
class ToyConfig(FitConfig):
    """The DDP tutorial's ToyModel on a synthetic regression task."""

    num_samples: int = 4096
    task: str = "regression"
    epochs: int = 5
    lr: float = 1e-2

    BOUNDS: ClassVar[Mapping[str, Bound]] = {"num_samples": at_least(1)}


@dataclass
class DigitsConfig(FitConfig):
    """An MLP on scikit-learn's bundled 8x8 digits."""

    hidden: int = 128
    epochs: int = 20
    lr: float = 2e-3
    lr_schedule: str = "cosine"

    BOUNDS: ClassVar[Mapping[str, Bound]] = {"hidden": at_least(1)}


@dataclass
class MnistConfig(FitConfig):
    """The tutorial's SimpleNet on MNIST-format IDX files (Fashion-MNIST from Debian by default)."""

    data: str = datasets.DEFAULT_MNIST_DIR
    batch_size: int = 64
    epochs: int = 2
    log_every: int = 50


@dataclass
class ResnetConfig(FitConfig):
    """A small ResNet with SyncBatchNorm on synthetic 32x32 images."""

    num_samples: int = 2048
    width: int = 16
    sync_batchnorm: bool = True
    epochs: int = 2
    lr: float = 2e-3

    BOUNDS: ClassVar[Mapping[str, Bound]] = {"num_samples": at_least(1), "width": at_least(1)}


@dataclass
class GptConfig(FitConfig):
    """A tiny character-level GPT on the standard library's source text."""

    context: int = 64
    dim: int = 64
    depth: int = 2
    heads: int = 4
    task: str = "language_model"
    max_steps: int | None = 300
    lr: float = 3e-3
    lr_schedule: str = "cosine"
    warmup_steps: int = 20
    clip_grad_norm: float | None = 1.0

    BOUNDS: ClassVar[Mapping[str, Bound]] = {
        name: at_least(1) for name in ("context", "dim", "depth", "heads")
    }


@dataclass
class Built:
    model: nn.Module
    train_data: Dataset
    eval_data: Dataset | None
    loss_fn: Callable[[Any, Any], torch.Tensor]


def _language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_toy(config: ToyConfig) -> Built:
    train, test = datasets.toy_regression(config.num_samples, seed=config.seed)
    return Built(models.ToyModel(), train, test, nn.functional.mse_loss)


def build_digits(config: DigitsConfig) -> Built:
    train, test = datasets.digits(seed=config.seed)
    return Built(models.DigitsNet(config.hidden), train, test, nn.functional.cross_entropy)


def build_mnist(config: MnistConfig) -> Built:
    train, test = datasets.mnist(config.data)
    return Built(models.SimpleNet(), train, test, nn.functional.cross_entropy)


def build_resnet(config: ResnetConfig) -> Built:
    train, test = datasets.synthetic_images(config.num_samples, seed=config.seed)
    return Built(models.SmallResNet(width=config.width), train, test, nn.functional.cross_entropy)


def build_gpt(config: GptConfig) -> Built:
    train, test, vocab = datasets.stdlib_text(config.context)
    model = models.TinyGPT(
        vocab, context=config.context, dim=config.dim, depth=config.depth, heads=config.heads
    )
    return Built(model, train, test, _language_model_loss)


JOBS: dict[str, tuple[type[FitConfig], Callable[[Any], Built]]] = {
    "toy": (ToyConfig, build_toy),
    "digits": (DigitsConfig, build_digits),
    "mnist": (MnistConfig, build_mnist),
    "resnet": (ResnetConfig, build_resnet),
    "gpt": (GptConfig, build_gpt),
}


def job(name: str) -> tuple[type[FitConfig], Callable[[Any], Built]]:
    if name not in JOBS:
        raise ConfigError(f"unknown job {name!r}; built-in jobs: {', '.join(JOBS)}")
    return JOBS[name]


def build(name: str, config: FitConfig) -> Built:
    """Build job `name` with the same weights on every rank (the engine broadcasts rank 0's anyway)."""
    torch.manual_seed(config.seed)
    return job(name)[1](config)
