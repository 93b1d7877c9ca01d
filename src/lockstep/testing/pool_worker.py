"""The process side of lockstep.testing.pool: one rank process that runs call after call, each on a fresh
group, and says after each whether it is back in the state it started in.

Per call: the environment (rank, world, the store's port), torch's random state and the warning filters
are set as a fresh interpreter would have them; `lockstep.init`, `fn(*args)`, the result to the pool,
`lockstep.shutdown()`; then the environment and working directory are restored and the process compared
with its state before the call (`changes`). A call that raised ends the process: the pool replaces every
worker after a failure.

What is compared: a process group (torch.distributed), the hang watchdog, the threads (but the queue's
feeder and tqdm's monitor), the handlers of the signals a launcher sends, torch's global modes (default
dtype, grad, inference, anomaly detection, deterministic algorithms, threads), and the globals of every
module of lockstep and of the caller (tests, benchmarks): none rebound or deleted, and no module-level
list, dict or set changed (init(hang_timeout=...) keeps its setting in one); also no function of os,
time, shutil, socket or torch.distributed replaced. A change inside another kind of object (an instance's
attribute, a class attribute) is not seen.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
import pickle
import pkgutil
import signal
import sys
import threading
import traceback
import warnings
from typing import Any, NoReturn, cast

from lockstep.runtime.env import env_contract as ec

READY_TIMEOUT = 30.0  # leaving the group after a call: bounded, or the pool is replaced
# Threads that may stay: multiprocessing's queue feeder (the results), tqdm's monitor (started by the first
# progress bar; it only watches for stuck bars).
_HOUSEKEEPING = ("QueueFeederThread", "tqdm_monitor")
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_OWN_MODULES = ("lockstep", "tests", "benchmarks")  # every global is watched
_WATCHED_MODULES = (
    "os",
    "time",
    "shutil",
    "socket",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
)
_VALUES = (int, float, complex, str, bytes, bool, type(None), tuple, frozenset)
_CONTAINERS = (list, dict, set)


def worker_main(conn: Any, results: Any) -> None:
    """The worker's life: calls from `conn` until the pool closes it; results and "ready" to `results`."""
    os.setsid()  # own session: the pool kills this rank and everything it started at once
    import torch

    _import_all_of_lockstep()
    torch.set_num_threads(1)
    rng = torch.get_rng_state()
    filters = list(warnings.filters)
    baseline = _process_state()
    while True:
        try:
            task, rank, call = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn, env, backend, args, timeout = pickle.loads(call)  # imports fn's module (a test module)
        except BaseException:
            _fail(results, task, rank)
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        modules = _module_globals()
        torch.set_rng_state(rng)
        warnings.resetwarnings()  # also forgets which warnings were shown: each call sees them afresh
        cast("list[Any]", warnings.filters)[:] = filters  # typeshed says Sequence; it is a list
        os.environ.update(env)
        os.environ[ec.RANK_VAR] = str(rank)
        os.environ[ec.LOCAL_RANK_VAR] = str(rank)
        faulthandler.dump_traceback_later(max(1.0, timeout - 2.0), exit=False, file=sys.stderr)
        try:
            from lockstep.runtime.process_group import init, shutdown

            init(backend, timeout=timeout)
            value = fn(*args)
            results.put((task, rank, "ok", pickle.dumps(value)))
            faulthandler.cancel_dump_traceback_later()
            # A worker stuck leaving the group prints its stack before the pool gives up on it.
            faulthandler.dump_traceback_later(READY_TIMEOUT - 5.0, exit=False, file=sys.stderr)
            shutdown()
        except BaseException:
            faulthandler.cancel_dump_traceback_later()
            _fail(results, task, rank)
        faulthandler.cancel_dump_traceback_later()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        results.put((task, rank, "ready", changes(baseline, modules)))


def changes(baseline: dict[str, Any], modules: dict[str, dict[str, Any]]) -> str | None:
    """What differs from `baseline` (the process state at start) and `modules` (the globals before the
    call), or None: the worker can take another call."""
    now = _process_state()
    found = [f"{key}: {baseline[key]!r} -> {now[key]!r}" for key in baseline if baseline[key] != now[key]]
    rebound = _rebound(modules, _module_globals())
    if rebound:
        found.append("module globals: " + ", ".join(rebound[:5]) + (" ..." if len(rebound) > 5 else ""))
    return "; ".join(found) or None


def _fail(results: Any, task: int, rank: int) -> NoReturn:
    """Report the exception being handled as this rank's error and exit."""
    results.put((task, rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(1)


def _import_all_of_lockstep() -> None:
    """Every lockstep module, imported before any call: each one's globals are then in the snapshot
    before the call that first uses it (one that imports lockstep.engine.deterministic.exact to set its
    BUCKET_ELEMENTS is seen doing so). Only to watch them: nothing here uses them."""
    package = sys.modules["lockstep"]
    for info in pkgutil.walk_packages(package.__path__, "lockstep."):
        if not info.name.endswith("__main__"):
            with contextlib.suppress(ImportError):
                importlib.import_module(info.name)


def _process_state() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lockstep.runtime import watchdog

    current = getattr(watchdog, "current", None)
    return {
        "process group": dist.is_initialized(),
        "hang watchdog": current() is not None if callable(current) else False,
        "threads": sorted(t.name for t in threading.enumerate() if not t.name.startswith(_HOUSEKEEPING)),
        "signal handlers": {int(s): repr(signal.getsignal(s)) for s in _SIGNALS},
        "default dtype": str(torch.get_default_dtype()),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "anomaly detection": torch.is_anomaly_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch threads": torch.get_num_threads(),
    }


def _module_globals() -> dict[str, dict[str, Any]]:
    """Per watched module, its globals: (value, a shallow copy of a list/dict/set value, else None)."""
    snapshot = {}
    for name, module in list(sys.modules.items()):
        if module is None:
            continue
        if name.split(".")[0] in _OWN_MODULES:
            snapshot[name] = {k: (v, _contents(v)) for k, v in vars(module).items() if not k.startswith("__")}
        elif name in _WATCHED_MODULES:  # only its functions: its other globals change with every group
            snapshot[name] = {
                k: (v, None) for k, v in vars(module).items() if callable(v) and not isinstance(v, type)
            }
    return snapshot


def _contents(value: Any) -> Any:
    if type(value) is list:
        return list(value)
    if type(value) is dict:
        return dict(value)
    if type(value) is set:
        return set(value)
    return None


def _rebound(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """Globals rebound, deleted or (list, dict, set) changed; names that a first import added are none."""
    changed = []
    for module, names in before.items():
        now = after.get(module, {})
        for name, (value, contents) in names.items():
            if name not in now:
                changed.append(f"{module}.{name} deleted")
            elif not _same(value, now[name][0]):
                changed.append(f"{module}.{name} rebound")
            elif contents is not None and not _same_contents(contents, now[name][1]):
                changed.append(f"{module}.{name} changed")
    return changed


def _same(a: Any, b: Any) -> bool:
    """The same object, or an equal plain value (a constant set back to what it was is no change)."""
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, _VALUES):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  a tuple of tensors, say: not comparable, so not the same
        return False


def _same_contents(a: Any, b: Any) -> bool:
    """Two shallow copies hold the same objects (compared by identity: no tensor is compared by value)."""
    if type(a) is not type(b) or len(a) != len(b):
        return False
    if isinstance(a, list):
        return all(x is y for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return bool(a == b)  # sets: of hashable (comparable) elements
