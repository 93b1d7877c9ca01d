"""Start one node's workers with torch's elastic agent and supervise them: `launch(spec) -> exit code`.

Python API (what `lockstep run` and `lockstep train` call)::

    from lockstep.launch.spec import LaunchSpec
    from lockstep.launch.local import launch

    code = launch(LaunchSpec("train.py", args=("--lr", "3"), nproc_per_node=2, run_dir="runs/a"))

`launch` builds a `torch.distributed.launcher.api.LaunchConfig` and calls `elastic_launch`: torch's agent
starts the workers (each in its own session, so one `killpg` reaches its DataLoader workers too), runs the
c10d rendezvous and monitors them. We add only what torch leaves out:

- single node: c10d rendezvous on 127.0.0.1 port 0, so the kernel picks a free port when the store binds
  (as `torchrun --standalone`); two runs at once never collide;
- OMP_NUM_THREADS = usable cores // processes (at least 1) unless the user set it; PYTHONUNBUFFERED=1 so
  that rank 0 streams live;
- each worker runs under `lockstep.launch.worker`, which keeps the script's argv untouched and records its
  traceback where the agent reads it;
- per-rank logs in the run directory (`<run_dir>/rank<R>/{stdout,stderr}.log`, `restart<k>/rank<R>` after
  a restart), relayed to the console by `output.ConsoleRelay`;
- one failure summary (`output.format_failure`) and an exit code: 0 on success, the first failing rank's
  exit code (128 + signal if it was killed), 128 + signal when the launcher itself is interrupted;
- Ctrl-C / SIGTERM: torch's agent forwards the signal to every worker's process group and SIGKILLs them
  after `spec.shutdown_grace` seconds; then every worker's process group is SIGKILLed again, by the pids
  the workers wrote, so that nothing outlives the launcher. A script that handles SIGTERM gets that grace
  to save its state and exit;
- SIGUSR1 / SIGUSR2 are passed on to every worker (not to their DataLoader workers), and the run goes on:
  SLURM's `--signal=USR1@T` before the time limit reaches the training script (see `_forward_signals`).

Multi-node: `--nnodes`, `--rdzv-endpoint`, `--rdzv-id`, `--rdzv-conf`, `--local-addr` go to the agent
unchanged; `--node-rank 0` / `N` become `is_host=1` / `0` for the c10d store unless `--rdzv-conf` says,
and `--network-interface` sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the workers (without it, the
interface that holds `--local-addr`, unless those are set: `collective_interface`). The c10d
rendezvous is torch's, wrapped (launch/rendezvous.py) so that every node numbers a restart the same way:
after one node's failure all nodes restart, and their workers meet under the same attempt number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from lockstep.errors import ConfigError, LaunchError
from lockstep.launch.output import Console, ConsoleRelay, RankFailure, first_failure, format_failure
from lockstep.launch.spec import LaunchSpec, check_entrypoint, parse_endpoint
from lockstep.launch.worker import PID_FILE

_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # for the script (e.g. SLURM's "checkpoint now")
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def launch(spec: LaunchSpec, *, cwd: str | None = None, console: Console | None = None) -> int:
    """Run `spec` on this node; return the exit code (see the module doc). Raises ConfigError on bad input."""
    cwd = cwd or os.getcwd()
    check_entrypoint(spec, cwd)
    console = console or Console(sys.stdout, sys.stderr)
    run_dir = make_run_dir(spec.run_dir, cwd)
    threads, threads_note = omp_threads(spec)
    rdzv_conf = rendezvous_conf(spec)
    if spec.is_multi_node:
        check_endpoint_free(spec, rdzv_conf)
    relay = ConsoleRelay(console, logs=spec.logs)
    state: dict[str, Any] = {"world_size": None, "rank_dirs": {}, "all_dirs": []}

    def on_attempt(attempt: int, ranks: Mapping[int, str], env0: Mapping[str, str]) -> None:
        state["world_size"] = int(env0.get("WORLD_SIZE", "0")) or None
        state["rank_dirs"].update(ranks)
        state["all_dirs"].extend(ranks.values())
        if attempt == 0:
            console.line("stderr", header(spec, env0, threads_note, run_dir))
        else:
            console.line("stderr", restart_line(attempt, int(env0.get("TORCHELASTIC_RESTART_COUNT", attempt)),
                                                spec.max_restarts, os.path.dirname(next(iter(ranks.values())))))
        for rank, rank_dir in sorted(ranks.items()):
            relay.follow(rank, os.path.join(rank_dir, "stdout.log"), os.path.join(rank_dir, "stderr.log"))

    interface, interface_note = collective_interface(spec, os.environ)
    if spec.is_multi_node:
        console.line("stderr", f"lockstep run: waiting for {_nodes(spec)} at {spec.endpoint} "
                               f"(rendezvous {spec.rdzv_backend}, id {spec.rdzv_id or 'none'}"
                               f"{', ' + interface_note if interface_note else ''}); logs in {run_dir}")
    config = _launch_config(spec, run_dir, rdzv_conf, on_attempt)
    worker_env = _worker_env(spec, threads, interface)
    relay.start()
    code, report = 1, ""

    def forward_to() -> list[str]:  # this node's current attempt
        return list(state["rank_dirs"].values())

    with _environ(worker_env), _signals_raise(), _forward_signals(forward_to), _torch_logs(spec.verbose):
        try:
            code, report = _run_agent(config, spec, state)
        finally:
            _quietly_finish(relay, state["all_dirs"])
    if report:
        console.line("stderr", report)  # after the relay drained: the summary is the last thing shown
    return code


def _run_agent(config: Any, spec: LaunchSpec, state: dict[str, Any]) -> tuple[int, str]:
    """Run torch's agent; return (exit code, final report)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    kind = "module" if spec.module else "script"
    try:
        elastic_launch(config, sys.executable)("-m", "lockstep.launch.worker", kind, spec.entrypoint, *spec.args)
        return 0, ""
    except ChildFailedError as err:
        failures = [
            RankFailure(rank, f.local_rank, f.pid, f.exitcode, f.error_file_data or {}, state["rank_dirs"].get(rank))
            for rank, f in err.failures.items()
        ]
        first = first_failure(failures)
        status = first.exit_status
        return (status if status > 0 else 128 - status), format_failure(failures, state["world_size"])
    except (SignalException, KeyboardInterrupt) as exc:
        sig = getattr(exc, "sigval", signal.SIGINT)
        return 128 + int(sig), (f"lockstep run: interrupted by {signal.Signals(sig).name}; "
                                "every worker's process group was stopped")
    except RendezvousError as exc:
        raise LaunchError(
            f"rendezvous at {spec.endpoint} failed ({type(exc).__name__}: {exc}); check that every node "
            "uses the same --rdzv-endpoint and --rdzv-id, that the head node is reachable on that port, "
            "and set --local-addr / --network-interface to this node's address on the shared network"
        ) from exc


def restart_line(attempt: int, own_restarts: int, max_restarts: int, logs: str) -> str:
    """The line shown when the workers start again: the job's attempt and this node's restarts used. On a
    node restarted for a peer's failure (the rendezvous reopened) the two differ: it spent none of its own."""
    if own_restarts == attempt:
        return f"lockstep run: restart {attempt}/{max_restarts}; logs in {logs}"
    return (f"lockstep run: restart {attempt} of the job (another node's workers stopped; this node has used "
            f"{own_restarts}/{max_restarts} of its restarts); logs in {logs}")


def header(spec: LaunchSpec, env0: Mapping[str, str], threads_note: str, run_dir: str) -> str:
    """The first line: what was resolved (processes x nodes, backend, endpoint, threads, logs)."""
    import torch

    from lockstep.runtime.process_group import choose_backend

    backend = choose_backend("cuda" if torch.cuda.is_available() else "cpu")
    nnodes = int(env0.get("GROUP_WORLD_SIZE", spec.max_nodes))
    endpoint = f"{env0.get('MASTER_ADDR', '?')}:{env0.get('MASTER_PORT', '?')}"
    shown = "rank 0 here, other ranks' warnings/errors" if spec.logs == "rank0" else "all ranks here"
    return (
        f"lockstep run: {spec.nproc_per_node} process{'es' if spec.nproc_per_node != 1 else ''} x {nnodes} "
        f"node{'s' if nnodes != 1 else ''} (world {env0.get('WORLD_SIZE', '?')}), backend {backend}, "
        f"endpoint {endpoint}, {threads_note}, logs in {run_dir} ({shown})"
    )


def make_run_dir(requested: str | None, cwd: str) -> str:
    """The run directory: the one asked for, or a fresh ./runs/<YYYYmmdd-HHMMSS>-<id>."""
    if requested:
        path = os.path.abspath(os.path.join(cwd, requested))
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create --run-dir {requested!r} ({exc.strerror}); pick a writable directory") from None
        return path
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    path = os.path.join(cwd, "runs", name)
    try:
        os.makedirs(path)
    except OSError:
        import tempfile

        path = tempfile.mkdtemp(prefix=f"lockstep-{name}-")  # the working directory is read-only
    return path


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def omp_threads(spec: LaunchSpec) -> tuple[str, str]:
    """(OMP_NUM_THREADS for the workers, how it was chosen): the user's, else cores // processes."""
    user = spec.env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if user:
        return user, f"OMP_NUM_THREADS={user} (set by you)"
    cores = usable_cores()
    threads = max(1, cores // spec.nproc_per_node)
    return str(threads), f"OMP_NUM_THREADS={threads} ({cores} cores / {spec.nproc_per_node} process{'es' if spec.nproc_per_node != 1 else ''})"


def rendezvous_conf(spec: LaunchSpec) -> dict[str, Any]:
    """--rdzv-conf, plus is_host from --node-rank (node 0 hosts the c10d store) unless given."""
    conf: dict[str, Any] = dict(spec.rdzv_conf)
    if spec.rdzv_backend == "c10d" and spec.is_multi_node and spec.node_rank is not None:
        conf.setdefault("is_host", "1" if spec.node_rank == 0 else "0")
    if spec.rdzv_backend == "static" and spec.node_rank is not None:
        conf.setdefault("rank", str(spec.node_rank))
    return conf


def check_endpoint_free(spec: LaunchSpec, rdzv_conf: Mapping[str, Any]) -> None:
    """Fail early, naming the flag, when this node must host the store and the port is already taken."""
    host, port = parse_endpoint(spec.endpoint)
    is_host = str(rdzv_conf.get("is_host", "")).lower()
    hosting = is_host in ("1", "true", "yes") or (is_host == "" and host in (*_LOCAL_HOSTS, socket.gethostname()))
    if not hosting or port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the TCP store does
        try:
            probe.bind(("" if host in ("0.0.0.0", socket.gethostname()) else host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--rdzv-endpoint {spec.endpoint}: port {port} is already in use on this node (another job "
                    f"or a previous run still holding it); pick another port, e.g. {host}:{port + 1}, "
                    "the same on every node"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"--rdzv-endpoint {spec.endpoint}: this node is the rendezvous host but has no address "
                    f"{host!r}; use this node's own address, or --rdzv-conf is_host=0 on the other nodes"
                ) from None


def _nodes(spec: LaunchSpec) -> str:
    count = str(spec.max_nodes) if spec.min_nodes == spec.max_nodes else f"{spec.min_nodes}-{spec.max_nodes}"
    return f"{count} nodes"


def _launch_config(spec: LaunchSpec, run_dir: str, rdzv_conf: dict[str, Any], on_attempt: Any) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    from lockstep.launch import rendezvous
    from lockstep.launch.logs import RunDirLogs

    agreed = rendezvous.AgreedAttempt()
    backend, configs = spec.rdzv_backend, dict(rdzv_conf)
    if backend == "c10d":
        # torch's c10d rendezvous, plus one attempt number per round that every node agrees on.
        backend, configs[rendezvous.SINK_KEY] = rendezvous.register(), agreed
    options: dict[str, Any] = {
        "min_nodes": spec.min_nodes,
        "max_nodes": spec.max_nodes,
        "nproc_per_node": spec.nproc_per_node,
        "logs_specs": RunDirLogs(run_dir, on_attempt, agreed),
        "run_id": spec.rdzv_id or (uuid.uuid4().hex if not spec.is_multi_node else "none"),
        "role": "worker",
        "rdzv_endpoint": spec.endpoint,
        "rdzv_backend": backend,
        "rdzv_configs": configs,
        "max_restarts": spec.max_restarts,
        "monitor_interval": spec.monitor_interval,
        "start_method": "spawn",
        "local_addr": spec.local_addr,
    }
    # Older torch has no shutdown_timeout field (it waits 30 s before SIGKILL); use it where it exists.
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        options["shutdown_timeout"] = max(1, math.ceil(spec.shutdown_grace))
    return LaunchConfig(**options)


def _worker_env(spec: LaunchSpec, threads: str, interface: str | None) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    if interface:
        for name in _IFNAME_VARS:
            env[name] = spec.network_interface or os.environ.get(name) or interface
    env.update(spec.env)
    return env


def collective_interface(spec: LaunchSpec, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(the interface gloo and nccl use on this node, how it was chosen; "" when nothing is set).

    --network-interface wins. Else, on a multi-node run with --local-addr, the interface that holds that
    address, unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are already set (the user's, kept as they are):
    without it, gloo tells its peers the address the host name resolves to, 127.0.0.1 on many containers.
    """
    if spec.network_interface:
        return spec.network_interface, f"network interface {spec.network_interface}"
    if not (spec.is_multi_node and spec.local_addr):
        return None, ""
    if all(environ.get(name) or spec.env.get(name) for name in _IFNAME_VARS):
        return None, ""
    from lockstep.launch.netif import interface_for

    found = interface_for(spec.local_addr)
    return found, (f"network interface {found} (it holds --local-addr {spec.local_addr})" if found else "")


@contextlib.contextmanager
def _environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Workers inherit the launcher's environment: set `extra` for the duration of the launch only."""
    touched = [*extra, "TORCHELASTIC_SIGNALS_TO_HANDLE"]  # the agent sets the latter and never unsets it
    saved = {key: os.environ.get(key) for key in touched}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """From the first moment, SIGINT/SIGTERM/... raise torch's SignalException in the launcher, which the
    agent answers by stopping the workers; the previous handlers come back afterwards."""
    from torch.distributed.elastic.multiprocessing import SignalException

    def handler(signum: int, frame: Any) -> None:
        raise SignalException(f"lockstep run got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    saved = {sig: signal.getsignal(sig) for sig in _HANDLED_SIGNALS}
    for sig in _HANDLED_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _forward_signals(rank_dirs: Callable[[], list[str]]) -> Iterator[None]:
    """SIGUSR1/SIGUSR2 sent to the launcher go on to every worker of this node's current attempt, and the
    run goes on (what the script does with them is its own business: SLURM's `--signal=USR1@T` asks it to
    checkpoint before the time limit). To the worker process only: its DataLoader workers would die of them.

    A signal the launcher was started with ignored stays ignored, as a shell leaves it: `lockstep slurm`'s
    script starts the launchers under `trap '' USR1` because srun already delivers USR1 to every process of
    the step, workers included, and they must not get it twice.
    """

    def forward(signum: int, frame: Any) -> None:
        for pid in worker_pids(rank_dirs()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    saved = {sig: signal.getsignal(sig) for sig in _FORWARDED_SIGNALS}
    forwarded = [sig for sig, previous in saved.items() if previous != signal.SIG_IGN]
    for sig in forwarded:
        signal.signal(sig, forward)
    try:
        yield
    finally:
        for sig in forwarded:
            previous = saved[sig]
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def worker_pids(rank_dirs: list[str]) -> list[int]:
    """The pids the workers wrote in their rank directories, for those that are still this launcher's
    children (a worker that exited may have left its pid to an unrelated process)."""
    pids = []
    for rank_dir in rank_dirs:
        pid = _read_pid(rank_dir)
        if pid is not None and _parent_of(pid) in (os.getpid(), None):
            pids.append(pid)
    return pids


def _read_pid(rank_dir: str) -> int | None:
    try:
        with open(os.path.join(rank_dir, PID_FILE)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _parent_of(pid: int) -> int | None:
    """pid's parent pid from /proc (-1 when pid is gone), or None where there is no /proc to ask."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces: split after it
    except (OSError, ValueError, IndexError):
        return -1


@contextlib.contextmanager
def _torch_logs(verbose: bool) -> Iterator[None]:
    """torch's agent logs every step at WARNING; our header and summary say it better, unless --verbose.
    torch sets a level on each of its module loggers, so each one is raised (and restored) here."""
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401  (creates its logger)
    import torch.distributed.launcher.api  # noqa: F401

    names = [name for name in logging.root.manager.loggerDict
             if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    if not verbose:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, saved):
            logger.setLevel(level)


def _quietly_finish(relay: ConsoleRelay, rank_dirs: list[str]) -> None:
    """With signals held off (a second Ctrl-C must not cut it short): kill what is left, drain the logs."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED_SIGNALS)
    try:
        kill_leftovers(rank_dirs)
        relay.stop()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def kill_leftovers(rank_dirs: list[str]) -> list[int]:
    """SIGKILL the process group of every worker of this launch (by the pid each wrote in its rank
    directory); return the groups that still had members. Each worker leads its own group, so this reaches
    its DataLoader workers and anything else it started, and nothing outside the run."""
    killed = []
    for rank_dir in rank_dirs:
        pid = _read_pid(rank_dir)
        if pid is None:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed
