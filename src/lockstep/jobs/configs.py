"""The built-in jobs' settings: one FitConfig subclass per job of `lockstep train`.

Apart from the builders (catalog.py) and without torch: `lockstep train` resolves a job's settings and
checks its plan (lockstep/plan.py) before it imports torch or starts a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from lockstep.trainer.settings.config import Bound, FitConfig, at_least

DEFAULT_MNIST_DIR = "/usr/share/datasets/fashion-mnist/"


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

    data: str = DEFAULT_MNIST_DIR
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


CONFIGS: dict[str, type[FitConfig]] = {
    "toy": ToyConfig,
    "digits": DigitsConfig,
    "mnist": MnistConfig,
    "resnet": ResnetConfig,
    "gpt": GptConfig,
}
