"""Start-up hook: lockstep's DistributedDataParallel under torch's names in this Python process.

This directory goes first on PYTHONPATH (`lockstep run --ddp lockstep`, `lockstep.use_lockstep_ddp()`);
Python runs `sitecustomize` at start-up. It imports nothing heavy: it waits for the program's own
`import torch` to finish, then swaps (lockstep/startup/__init__.py). A sitecustomize that this file shadows
(one further down sys.path) still runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


class _SwapAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch` is first imported, wraps its loader so that the swap runs
    right after torch's own initialisation ends."""

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        load_torch = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load_torch(module)
            from lockstep.startup import swap_torch_names

            swap_torch_names()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _install() -> None:
    if "torch" in sys.modules:  # imported before site ran (not from a normal start): swap at once
        from lockstep.startup import swap_torch_names

        swap_torch_names()
        return
    sys.meta_path.insert(0, _SwapAfterTorch())


def _run_shadowed_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_install()
_run_shadowed_sitecustomize()
