"""Run a function on N real gloo ranks in fresh subprocesses, with a fresh rendezvous and a hard timeout.

The parent hosts the rendezvous store on a port the kernel picks (port 0), so concurrent runs never
collide; each rank runs in its own session so that a timeout kills it together with anything it started
(DataLoader workers included). A hang fails in `timeout` seconds with every hung rank's Python stack.
While a RankPool is in use (lockstep.testing.pool.use_pool), calls it can serve run on its processes
instead, with the same contract.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from lockstep.errors import DistributedTestError
from lockstep.runtime.env import env_contract as ec

DEFAULT_TIMEOUT = 90.0
# The lockstep.testing.pool.RankPool that run_distributed offers its calls to (set by pool.use_pool).
ROUTED: list[Any] = []
_GRACE_AFTER_FAILURE = 5.0


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Call `fn(*args)` on ranks 0..world_size-1 after `lockstep.init(backend)`; return results by rank.

    `fn` must be importable (defined at module level). Raises DistributedTestError naming each failed
    rank with its traceback, or the ranks still running when `timeout` seconds have passed.
    """
    import torch.distributed as dist

    if ROUTED and not env:
        pooled = ROUTED[0].try_run(fn, world_size, args=args, timeout=timeout, backend=backend)
        if pooled is not None:
            return pooled

    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, True, timedelta(seconds=timeout), wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    child_env = {
        ec.MASTER_ADDR_VAR: "127.0.0.1",
        ec.MASTER_PORT_VAR: str(store.port),
        ec.WORLD_SIZE_VAR: str(world_size),
        ec.LOCAL_WORLD_SIZE_VAR: str(world_size),
        ec.AGENT_STORE_VAR: ec.AGENT_STORE_ON,  # every rank is a client of the store hosted here
        ec.RESTART_COUNT_VAR: "0",
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    procs = [
        ctx.Process(
            target=_child_main,
            args=(fn, rank, child_env, backend, tuple(args), timeout, results),
            name=f"lockstep-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        outcomes = _collect(procs, results, timeout)
    finally:
        _kill_all(procs)
        del store
    return _unpack(outcomes, world_size, timeout)


def _collect(procs: list[Any], results: Any, timeout: float) -> dict[int, tuple[str, Any]]:
    world_size = len(procs)
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=0.1)
            outcomes[rank] = (status, payload)
            if status == "error":
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs):
            if rank not in outcomes and not proc.is_alive():
                # It may have put its result just before exiting: drain once more before calling it a crash.
                _drain(results, outcomes, wait=0.5)
                if rank not in outcomes:
                    outcomes[rank] = ("died", _describe_exit(proc.exitcode))
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
    _drain(results, outcomes, wait=0.0)
    return outcomes


def _drain(results: Any, outcomes: dict[int, tuple[str, Any]], wait: float) -> None:
    while True:
        try:
            rank, status, payload = results.get(timeout=wait) if wait else results.get_nowait()
        except queue.Empty:
            return
        outcomes.setdefault(rank, (status, payload))
        wait = 0.0


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code} without reporting a result"


def _unpack(outcomes: dict[int, tuple[str, Any]], world_size: int, timeout: float) -> list[Any]:
    problems = []
    for rank in range(world_size):
        status, payload = outcomes.get(rank, ("hung", None))
        if status == "error":
            problems.append(f"[rank {rank}/{world_size}] raised:\n{payload}")
        elif status == "died":
            problems.append(f"[rank {rank}/{world_size}] {payload}")
        elif status == "hung":
            problems.append(
                f"[rank {rank}/{world_size}] did not finish within {timeout:.0f} s and was killed "
                "(its Python stack is printed on stderr above)"
            )
    if problems:
        raise DistributedTestError("distributed run failed:\n" + "\n".join(problems))
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


def _kill_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        proc.join(timeout=5)


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    env: Mapping[str, str],
    backend: str,
    args: tuple[Any, ...],
    timeout: float,
    results: Any,
) -> None:
    os.setsid()  # own process group: the parent can kill this rank and everything it started at once
    os.environ.update(env)
    os.environ[ec.RANK_VAR] = str(rank)
    os.environ[ec.LOCAL_RANK_VAR] = str(rank)
    # Print this rank's stack shortly before the parent gives up on it: the diagnosis of a hang.
    faulthandler.dump_traceback_later(max(1.0, timeout - 2.0), exit=False, file=sys.stderr)
    try:
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        from lockstep.runtime.process_group import init, shutdown

        init(backend, timeout=timeout)
        value = fn(*args)
        results.put((rank, "ok", pickle.dumps(value)))
        shutdown()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        results.close()
        results.join_thread()
