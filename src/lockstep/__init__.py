"""lockstep: data-parallel training for PyTorch, with its own DDP engine in Python.

Names resolve at first use (PEP 562 `__getattr__`), so `lockstep run` starts without importing the engine;
type checkers and IDEs read the real names from the `TYPE_CHECKING` imports below and the literal `__all__`.

The public subpackages (`lockstep.engine`, `.data`, `.checkpoint`, `.runtime`, `.trainer`, `.nn`, `.hooks`,
`.testing`, `.errors`) import their names eagerly; the names here are re-exports of theirs.
tests/unit/test_public_api.py pins the whole surface (names and signatures).

Modules:
- __main__.py: `python -m lockstep ...`: the same as the `lockstep` console script.
- cli.py: The `lockstep` command: a thin dispatcher to its subcommands (run, slurm, env, train, compare).
- errors.py: The lockstep exception hierarchy: every error a user can meet, each with a message that says what
  to do.
- hooks.py: Public communication hooks under torch's names: only the import changes.
- nn.py: Public neural-network layers of lockstep: SyncBatchNorm that works on every device and backend.
- plan.py: The run's plan: which of a run's settings combine, decided once from one table, before any worker
  starts.
- plan_settings.py: A run's settings as the plan reads them (`RunSettings`), and the checks on their values
  that no pair of switches states (lockstep/plan.py asks them at every door).
- plan_table.py: The table of lockstep/plan.py: the run settings as each door names them, and what every pair
  of them does.
- torch_private.py: Every private name of torch's that lockstep uses, in one place: what it is, why no public
  one serves.
- checkpoint/: Atomic, rank-0-written, weights_only-loadable checkpoints of everything a run needs to continue
  exactly.
- data/: Sharding samples across ranks: a world-size-independent, resumable training order and exact
  evaluation.
- engine/: lockstep's own data-parallel engine: replicas kept identical by averaging gradients during
  backward.
- jobs/: Built-in training jobs (`lockstep train JOB`): models, data that ships with the install, and their
  configs.
- launch/: The launcher: `lockstep run` (local and multi-node, on torch's elastic agent), `lockstep slurm`,
  `lockstep env`.
- runtime/: Who am I and how do I talk to the others: topology, process group, small collectives, rank-aware
  logs.
- startup/: lockstep's DistributedDataParallel under torch's names (`use_lockstep_ddp()`), and the Lightning
  strategy.
- testing/: Testing distributed code for real: N gloo ranks in subprocesses with a hard timeout, and parity
  checks.
- trainer/: The trainer: `fit()`, the loop that puts engine, sampler, checkpoints, metrics and progress
  together.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lockstep.errors import UnknownNameError

__version__ = "0.1.0"

if TYPE_CHECKING:  # what static tools see; the same table as _EXPORTS (a test checks that they agree)
    from lockstep import checkpoint, data, engine, errors, hooks, nn, runtime, testing, trainer
    from lockstep.engine import (
        DistributedDataParallel,
        EngineStats,
        GradBucket,
        ReplicaHandle,
        ShardHandle,
        ShardPolicy,
        StepStats,
        SyncPolicy,
        replicate,
        shard,
    )
    from lockstep.runtime import (
        Topology,
        all_reduce_mean,
        barrier,
        broadcast_object,
        get_logger,
        goodput,
        init,
        is_main,
        main_process_first,
        phase,
        shutdown,
    )
    from lockstep.startup import use_lockstep_ddp
    from lockstep.trainer import FitConfig, FitResult, LiveLoop, fit

# Public name -> the public subpackage that defines it (imported at first use, then cached in globals()).
_EXPORTS: dict[str, str] = {
    "Topology": "lockstep.runtime",
    "init": "lockstep.runtime",
    "shutdown": "lockstep.runtime",
    "is_main": "lockstep.runtime",
    "barrier": "lockstep.runtime",
    "main_process_first": "lockstep.runtime",
    "all_reduce_mean": "lockstep.runtime",
    "broadcast_object": "lockstep.runtime",
    "get_logger": "lockstep.runtime",
    "phase": "lockstep.runtime",
    "goodput": "lockstep.runtime",
    "DistributedDataParallel": "lockstep.engine",
    "EngineStats": "lockstep.engine",
    "GradBucket": "lockstep.engine",
    "ReplicaHandle": "lockstep.engine",
    "StepStats": "lockstep.engine",
    "SyncPolicy": "lockstep.engine",
    "replicate": "lockstep.engine",
    "shard": "lockstep.engine",
    "ShardHandle": "lockstep.engine",
    "ShardPolicy": "lockstep.engine",
    "FitConfig": "lockstep.trainer",
    "FitResult": "lockstep.trainer",
    "fit": "lockstep.trainer",
    "LiveLoop": "lockstep.trainer",
    "use_lockstep_ddp": "lockstep.startup",
}
_SUBMODULES = ("checkpoint", "data", "engine", "errors", "hooks", "nn", "runtime", "testing", "trainer")

# A literal list: static tools read __all__ only when it is written out.
__all__ = [
    "DistributedDataParallel",
    "EngineStats",
    "FitConfig",
    "FitResult",
    "GradBucket",
    "LiveLoop",
    "ReplicaHandle",
    "ShardHandle",
    "ShardPolicy",
    "StepStats",
    "SyncPolicy",
    "Topology",
    "__version__",
    "all_reduce_mean",
    "barrier",
    "broadcast_object",
    "checkpoint",
    "data",
    "engine",
    "errors",
    "fit",
    "get_logger",
    "goodput",
    "hooks",
    "init",
    "is_main",
    "main_process_first",
    "nn",
    "phase",
    "replicate",
    "runtime",
    "shard",
    "shutdown",
    "testing",
    "trainer",
    "use_lockstep_ddp",
]

if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt `lockstep.X` is an error, not Any

    def __getattr__(name: str) -> Any:
        if name in _EXPORTS:
            value = getattr(importlib.import_module(_EXPORTS[name]), name)
        elif name in _SUBMODULES:
            value = importlib.import_module(f"lockstep.{name}")
        else:
            raise UnknownNameError(
                f"module 'lockstep' has no attribute {name!r}; its public names are lockstep.__all__: "
                f"{', '.join(__all__)}"
            )
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The public names (resolved or not) and the module's dunders, not its private helpers."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
