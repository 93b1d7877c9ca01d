"""lockstep's DistributedDataParallel under torch's names: `use_lockstep_ddp()`, and the start-up hook.

A program or a framework that asks torch for `torch.nn.parallel.DistributedDataParallel` gets lockstep's
class instead, with no edit to its code, in two ways:

- `lockstep run --ddp lockstep` puts `HOOK_DIRECTORY` first on the workers' PYTHONPATH: its
  `sitecustomize.py` runs when each worker's interpreter starts, and once torch has been imported (not
  before: a process that never imports torch pays nothing) puts lockstep's class under torch's names;
- `use_lockstep_ddp()`, called by a program that starts its own processes (Lightning without a launcher,
  `torch.multiprocessing.spawn`) or runs under plain torchrun: the same now, in this process, and the
  hook directory on PYTHONPATH for every Python process started after it.

Where the names are (`swap_torch_names`): `torch.nn.parallel.DistributedDataParallel`,
`torch.nn.parallel.distributed.DistributedDataParallel`, and any module already loaded (outside torch and
lockstep) that bound torch's class at its import, as Lightning does (`from torch.nn.parallel.distributed
import DistributedDataParallel`). lockstep's class is a subclass of torch's, so torch's own isinstance
checks still hold. Nothing here is imported by `import lockstep` or by the launcher's start.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any

# The directory holding only the start-up hook (hook/sitecustomize.py): what goes on PYTHONPATH.
HOOK_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hook")
_TORCH_MODULES = ("torch.nn.parallel", "torch.nn.parallel.distributed")


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
    import torch.nn.parallel
    import torch.nn.parallel.distributed

    from lockstep.engine.ddp import DistributedDataParallel, TorchDDP

    for name in _TORCH_MODULES:
        sys.modules[name].DistributedDataParallel = DistributedDataParallel  # type: ignore[attr-defined]
    for module in list(sys.modules.values()):
        if isinstance(module, ModuleType) and _may_rebind(module.__name__):
            _rebind(module, TorchDDP, DistributedDataParallel)
    return DistributedDataParallel


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
