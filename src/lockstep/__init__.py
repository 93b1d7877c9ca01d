"""lockstep: data-parallel training for PyTorch, with its own DDP engine in Python.

Public names resolve lazily so that `lockstep run` (the launcher) starts without importing the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Topology": "lockstep.runtime.topology",
    "init": "lockstep.runtime.process_group",
    "shutdown": "lockstep.runtime.process_group",
    "is_main": "lockstep.runtime.collectives",
    "barrier": "lockstep.runtime.collectives",
    "main_process_first": "lockstep.runtime.collectives",
    "all_reduce_mean": "lockstep.runtime.collectives",
    "broadcast_object": "lockstep.runtime.collectives",
    "get_logger": "lockstep.runtime.logging",
    "DistributedDataParallel": "lockstep.engine.api",
    "replicate": "lockstep.engine.api",
    "SyncPolicy": "lockstep.engine.policy",
    "fit": "lockstep.trainer.loop",
}
_SUBMODULES = ("data", "nn", "hooks", "checkpoint", "testing", "errors", "runtime", "engine", "trainer")

__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"lockstep.{name}")
    raise AttributeError(f"module 'lockstep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
