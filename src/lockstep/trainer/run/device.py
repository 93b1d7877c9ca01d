"""Where fit computes and in which precision: the device it trains on, and the autocast of its forwards."""

from __future__ import annotations

import contextlib

import torch

from lockstep.errors import ConfigError


def choose_device(requested: str) -> torch.device:
    """`requested`: "auto", "cpu" or "cuda" (FitConfig.device)."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "device='cuda' was asked for but torch.cuda.is_available() is False; use device='cpu'"
        )
    # init() bound this process's device (srun --gpus-per-task, shared nodes, ...): follow its choice
    return torch.device("cuda", torch.cuda.current_device())


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The forward's autocast for `precision` ("fp32", "bf16" or "fp16"; FitConfig.precision)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)
