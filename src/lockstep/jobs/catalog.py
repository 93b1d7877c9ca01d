"""The built-in jobs of `lockstep train`: each is a config dataclass (configs.py) plus a function that builds the run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep.errors import ConfigError
from lockstep.jobs import datasets, models
from lockstep.jobs.configs import DigitsConfig, GptConfig, MnistConfig, ResnetConfig, ToyConfig
from lockstep.trainer.settings.config import FitConfig


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
__all__ = [
    "JOBS",
    "Built",
    "DigitsConfig",
    "GptConfig",
    "MnistConfig",
    "ResnetConfig",
    "ToyConfig",
    "build",
    "job",
]


def job(name: str) -> tuple[type[FitConfig], Callable[[Any], Built]]:
    if name not in JOBS:
        raise ConfigError(f"unknown job {name!r}; built-in jobs: {', '.join(JOBS)}")
    return JOBS[name]


def build(name: str, config: FitConfig) -> Built:
    """Build job `name` with the same weights on every rank (the engine broadcasts rank 0's anyway)."""
    torch.manual_seed(config.seed)
    return job(name)[1](config)
