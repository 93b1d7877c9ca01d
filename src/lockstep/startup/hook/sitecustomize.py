"""Start-up hook: lockstep's DistributedDataParallel under torch's names in this Python process.

This directory goes first on PYTHONPATH (`lockstep run --ddp lockstep`, `lockstep.use_lockstep_ddp()`);
Python runs `sitecustomize` at start-up. It imports nothing heavy: the swap waits for the program's own
`import torch` to finish (lockstep/startup/__init__.py). The Lightning strategy "lockstep" is registered
too, when Lightning is installed. A sitecustomize that this file shadows (further down sys.path) still runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from lockstep.startup import register_lightning_strategy, swap_when_torch_loads

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed_sitecustomize() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


swap_when_torch_loads()
register_lightning_strategy()
_run_shadowed_sitecustomize()
