"""A pool of gloo rank processes kept alive across calls: torch is imported once, each call forms a fresh group.

`run_distributed` starts N interpreters per call: spawn, `import torch`, the caller's module, then the
group. On 2 cores that is ~1.5-2 s per call, most of a small multi-process test. A `RankPool` keeps its
worker processes alive between calls. Each call, like `run_distributed`:

- hosts a fresh rendezvous store in the calling process, on a port the kernel picks (port 0), so no two
  calls (nor two pools) ever share a store or a key;
- runs `lockstep.init(backend)` then `fn(*args)` on ranks 0..N-1 (worker i is always rank i), returns the
  results by rank, and raises DistributedTestError naming each rank that raised, died or did not finish
  within `timeout` seconds (printing a hung rank's Python stack first);
- leaves the group (`lockstep.shutdown()`) and checks that the worker is back in the state it started in
  (lockstep.testing.pool_worker says what is compared: no group, no watchdog, no extra thread, the same
  signal handlers and torch modes, no global of a lockstep or tests module rebound or, for a list, dict
  or set, changed). torch's random state, the warning filters, the environment and the working directory
  are reset for every call.

Whatever goes wrong ends the whole pool: a rank that raised, died or hung, or a worker that is not back in
its starting state. Its processes (and anything they started) are killed at once and the next call starts
fresh ones. So a failure or a hang costs what it costs with `run_distributed`, and no call sees what an
earlier one left behind.

    with RankPool() as pool:
        pool.run(fn, 2)                  # as run_distributed(fn, 2)
        use_pool(pool)                   # or: route run_distributed's calls (gloo, no env) through it
        run_parity(cases, world=2)
        use_pool(None)

What a pool cannot see is a change inside another kind of object (an instance's or a class's attribute):
a rank function that keeps such state needs fresh processes (a test marked `fresh_ranks` in this
repository, or `run_distributed` with no pool in use).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import pickle
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from lockstep.errors import ConfigError
from lockstep.runtime.env import env_contract as ec
from lockstep.testing import spawn
from lockstep.testing.pool_worker import READY_TIMEOUT, worker_main

DEFAULT_SIZE = 4


class RankPool:
    """Up to `size` gloo rank processes reused across calls; `run` has run_distributed's contract.

    One call at a time: `run` waits for a call in progress in another thread, `try_run` (what
    run_distributed uses) declines and the caller starts fresh processes. `stats` counts calls, started
    processes and why the pool was replaced.
    """

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        if size < 1:
            raise ConfigError(f"RankPool(size={size}): expected at least one process")
        self.size = size
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._results: Any = None
        self._ready: dict[int, str | None] = {}  # this call's ranks back in their starting state (or why not)
        self._task = 0
        self._lock = threading.Lock()
        self.stats: dict[str, Any] = {"calls": 0, "started": 0, "replaced": []}
        atexit.register(self._replace, "exit")  # before multiprocessing would wait for the workers forever

    # ------------------------------------------------------------------ public

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int = 2,
        *,
        args: Sequence[Any] = (),
        timeout: float = spawn.DEFAULT_TIMEOUT,
        backend: str = "gloo",
        env: Mapping[str, str] | None = None,
    ) -> list[Any]:
        """Call `fn(*args)` on ranks 0..world_size-1 of a fresh group; return results by rank (as
        run_distributed). Blocks while another thread uses the pool."""
        with self._lock:
            return self._run(fn, world_size, tuple(args), timeout, backend, env)

    def try_run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *,
        args: Sequence[Any],
        timeout: float,
        backend: str,
    ) -> list[Any] | None:
        """The results by rank if the pool could take the call now, else None (the caller starts fresh
        processes): a backend other than gloo, more ranks than `size`, or the pool busy in another thread."""
        if backend != "gloo" or world_size > self.size:
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._run(fn, world_size, tuple(args), timeout, backend, None)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop every process of the pool (a later call starts fresh ones)."""
        with self._lock:
            self._replace("closed")

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one call

    def _run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        args: tuple[Any, ...],
        timeout: float,
        backend: str,
        env: Mapping[str, str] | None,
    ) -> list[Any]:
        import torch.distributed as dist

        if world_size < 1 or world_size > self.size:
            raise ConfigError(f"a pool of {self.size} processes cannot run a world of {world_size}")
        self.stats["calls"] += 1
        self._grow(world_size)
        self._task += 1
        task = self._task
        self._ready = {}
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, True, timedelta(seconds=timeout), wait_for_workers=False
        )
        rank_env = {
            ec.MASTER_ADDR_VAR: "127.0.0.1",
            ec.MASTER_PORT_VAR: str(store.port),
            ec.WORLD_SIZE_VAR: str(world_size),
            ec.LOCAL_WORLD_SIZE_VAR: str(world_size),
            ec.AGENT_STORE_VAR: ec.AGENT_STORE_ON,
            ec.RESTART_COUNT_VAR: "0",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        workers = self._workers[:world_size]
        try:
            call = pickle.dumps((fn, rank_env, backend, args, timeout))  # fn by reference, as spawn does
            for rank, worker in enumerate(workers):
                worker.conn.send((task, rank, call))
            outcomes = self._collect(task, workers, timeout)
            if any(status != "ok" for status, _ in outcomes.values()) or len(outcomes) < world_size:
                self._replace("a rank raised, died or hung")
            else:
                problem = self._await_ready(task, workers)
                if problem:
                    self._replace(problem)
        except BaseException:
            # Not handed over (unpicklable), or interrupted (pytest-timeout, Ctrl-C): the workers may still
            # be inside this call, so none of them can serve the next one.
            self._replace("a call could not be handed over or was interrupted")
            raise
        finally:
            del store
        return spawn._unpack(outcomes, world_size, timeout)

    def _collect(self, task: int, workers: list[_Worker], timeout: float) -> dict[int, tuple[str, Any]]:
        """Each rank's ("ok", payload) or ("error", traceback), or ("died", how); missing: hung."""
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < len(workers) and time.monotonic() < deadline:
            message = self._next(task, 0.1)
            if message is not None and message[2] in ("ok", "error"):
                _, rank, status, payload = message
                outcomes.setdefault(rank, (status, payload))
                if status == "error":
                    deadline = min(deadline, time.monotonic() + spawn._GRACE_AFTER_FAILURE)
            for rank, worker in enumerate(workers):
                if rank not in outcomes and not worker.proc.is_alive():
                    self._drain_into(task, outcomes, wait=0.5)
                    if rank not in outcomes:
                        outcomes[rank] = ("died", spawn._describe_exit(worker.proc.exitcode))
                        deadline = min(deadline, time.monotonic() + spawn._GRACE_AFTER_FAILURE)
        self._drain_into(task, outcomes, wait=0.0)
        return outcomes

    def _await_ready(self, task: int, workers: list[_Worker]) -> str | None:
        """None once every worker left the group and is back in its starting state, else why not."""
        deadline = time.monotonic() + READY_TIMEOUT
        while len(self._ready) < len(workers):
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(workers))) - set(self._ready))
                return f"ranks {missing} did not leave the group within {READY_TIMEOUT:.0f} s"
            self._next(task, 0.1)
            if any(not w.proc.is_alive() for w in workers):
                return "a worker exited after its call"
        problems = [f"rank {rank}: {why}" for rank, why in sorted(self._ready.items()) if why]
        return "; ".join(problems) or None

    def _next(self, task: int, wait: float) -> tuple[Any, ...] | None:
        """The next message of this call (None: none within `wait` s); "ready" ones are noted, whenever
        they come (a rank may be back before another has even finished)."""
        try:
            message = tuple(self._results.get(timeout=wait) if wait else self._results.get_nowait())
        except queue.Empty:
            return None
        if message[0] != task:
            return None  # an earlier call's: cannot happen (a pool that failed is replaced), ignored
        if message[2] == "ready":
            self._ready[message[1]] = message[3]
        return message

    def _drain_into(self, task: int, outcomes: dict[int, tuple[str, Any]], wait: float) -> None:
        while True:
            try:
                message = self._results.get(timeout=wait) if wait else self._results.get_nowait()
            except queue.Empty:
                return
            if message[0] == task and message[2] in ("ok", "error"):
                outcomes.setdefault(message[1], (message[2], message[3]))
            elif message[0] == task and message[2] == "ready":
                self._ready[message[1]] = message[3]
            wait = 0.0

    # ------------------------------------------------------------------ processes

    def _grow(self, world_size: int) -> None:
        if any(not w.proc.is_alive() for w in self._workers):
            self._replace("a worker had exited")
        if self._results is None:
            self._results = self._ctx.Queue()
        while len(self._workers) < world_size:
            parent, child = self._ctx.Pipe()
            # Not a daemon: a rank may start processes of its own (DataLoader workers). The pool stops its
            # workers at exit itself (close(), registered with atexit).
            proc = self._ctx.Process(
                target=worker_main,
                args=(child, self._results),
                name=f"lockstep-pool-rank-{len(self._workers)}",
            )
            proc.start()
            child.close()
            self._workers.append(_Worker(proc, parent))
            self.stats["started"] += 1

    def _replace(self, why: str) -> None:
        """Kill every worker (and what each started: its own session) and forget them and their queue."""
        if self._workers:
            self.stats["replaced"].append(why)
        spawn._kill_all([w.proc for w in self._workers])
        for worker in self._workers:
            worker.conn.close()
        self._workers = []
        if self._results is not None:
            self._results.close()
            self._results.cancel_join_thread()
            self._results = None


class _Worker:
    def __init__(self, proc: Any, conn: Any) -> None:
        self.proc, self.conn = proc, conn


def use_pool(pool: RankPool | None) -> RankPool | None:
    """Route run_distributed's calls through `pool` from now on (None: fresh processes again, the default);
    returns the pool in use before. Only gloo calls without `env` that fit the pool, made while no other
    thread uses it, go to the pool; every other call starts fresh processes as always."""
    previous = current_pool()
    spawn.ROUTED[:] = [pool] if pool is not None else []
    return previous


def current_pool() -> RankPool | None:
    return spawn.ROUTED[0] if spawn.ROUTED else None
