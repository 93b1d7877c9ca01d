"""lockstep's DistributedDataParallel under torch's names (`use_lockstep_ddp()`), and the Lightning strategy.

A program or a framework that asks torch for `torch.nn.parallel.DistributedDataParallel` gets lockstep's
class instead, with no edit to its code, in two ways:

- `lockstep run --ddp lockstep` puts `HOOK_DIRECTORY` first on the workers' PYTHONPATH: its
  `sitecustomize.py` runs when each worker's interpreter starts and, once torch has been imported (not
  before: a process that never imports torch pays nothing), puts lockstep's class under torch's names;
- `use_lockstep_ddp()`, called by a program that starts its own processes (Lightning without a launcher,
  `torch.multiprocessing.spawn`) or runs under plain torchrun: the same now, in this process, and the
  hook directory on PYTHONPATH for every Python process started after it.

Where the names are (`swap_torch_names`): `torch.nn.parallel.DistributedDataParallel`,
`torch.nn.parallel.distributed.DistributedDataParallel`, and any module already loaded (outside torch and
lockstep) that bound torch's class at its import, as Lightning does (`from torch.nn.parallel.distributed
import DistributedDataParallel`). lockstep's class is a subclass of torch's, so torch's own isinstance
checks still hold.

The Lightning strategy "lockstep" (lightning_strategy.py) is registered by `register_lightning_strategy()`
when Lightning's strategies load, if Lightning is installed: every `lockstep run` worker asks for it
(launch/worker.py), so that `strategy="lockstep"` is the one word a Lightning program changes.
Nothing here is imported by `import lockstep`; this module itself imports only the standard library.

Modules:
- lightning_strategy.py: The Lightning strategy "lockstep": Lightning's DDP strategy with lockstep's
  DistributedDataParallel.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["use_lockstep_ddp"]

# The directory holding only the start-up hook (hook/sitecustomize.py): what goes on PYTHONPATH.
HOOK_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook")
_TORCH_MODULES = ("torch.nn.parallel", "torch.nn.parallel.distributed")
# Lightning's two packages, each with its own strategy registry
LIGHTNING_STRATEGIES = ("lightning.pytorch.strategies", "pytorch_lightning.strategies")


def use_lockstep_ddp() -> None:
    """Run lockstep's engine wherever torch's DistributedDataParallel is asked for, here and in children.

    In this process: lockstep's class replaces torch's under torch's names, also where a module already
    imported bound it (call it before the model is wrapped). In every Python process started afterwards
    (Lightning's own rank processes, `mp.spawn` workers, subprocesses): the same, from their start, through
    the start-up hook put first on PYTHONPATH. Safe to call more than once and in a parent that never
    wraps a model. `lockstep run --ddp lockstep` does the same for its workers.
    """
    swap_torch_names()
    os.environ["PYTHONPATH"] = python_path(os.environ.get("PYTHONPATH"))


def python_path(existing: str | None) -> str:
    """`existing` PYTHONPATH with the hook directory first (once)."""
    parts = [p for p in (existing or "").split(os.pathsep) if p and p != HOOK_DIRECTORY]
    return os.pathsep.join([HOOK_DIRECTORY, *parts])


def swap_torch_names() -> type:
    """Put lockstep's class under torch's names (see the module docstring); returns lockstep's class."""
    from lockstep.engine.ddp import DistributedDataParallel, TorchDDP

    for name in _TORCH_MODULES:
        importlib.import_module(name).DistributedDataParallel = DistributedDataParallel  # type: ignore[attr-defined]
    for module in list(sys.modules.values()):
        if isinstance(module, ModuleType) and _may_rebind(module.__name__):
            _rebind(module, TorchDDP, DistributedDataParallel)
    return DistributedDataParallel


def swap_when_torch_loads() -> None:
    """The start-up hook's work: swap as soon as `import torch` has finished (at once if it has)."""
    after_import("torch", swap_torch_names)


def register_lightning_strategy() -> None:
    """Register the strategy "lockstep" in each of Lightning's packages that is installed, when (and only
    if) the program imports its strategies: Lightning is never imported here."""
    for name in LIGHTNING_STRATEGIES:
        top = name.partition(".")[0]
        if top in sys.modules or importlib.util.find_spec(top) is not None:
            after_import(name, _register_in(name))


def _register_in(strategies: str) -> Callable[[], None]:
    def register() -> None:
        from lockstep.startup.lightning_strategy import register_strategy

        register_strategy(strategies)

    return register


def after_import(name: str, then: Callable[[], Any]) -> None:
    """Call `then()` once module `name` has been imported completely (now, if it already is)."""
    if name in sys.modules:
        then()
        return
    sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `name` is first imported, wraps its loader so that `then` runs right
    after the module's own code has run."""

    def __init__(self, name: str, then: Callable[[], Any]) -> None:
        self.name, self.then = name, then

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module
        then = self.then

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            then()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _may_rebind(name: str) -> bool:
    # torch's own modules keep its class (lockstep's subclasses it: their isinstance checks still hold);
    # lockstep's keep it too: the engine refers to torch's class on purpose.
    return not (name == "torch" or name.startswith(("torch.", "lockstep")))


def _rebind(module: ModuleType, old: Any, new: Any) -> None:
    namespace = getattr(module, "__dict__", None)
    if not isinstance(namespace, dict):
        return
    for key, value in list(namespace.items()):
        if value is old:
            namespace[key] = new
