"""What torch's elastic agent and the workers are given: run directory, threads, rendezvous, LaunchConfig, env.

Everything here is decided before the agent starts and changes nothing the agent does on its own:

- single node: c10d rendezvous on 127.0.0.1 port 0, so the kernel picks a free port when the store binds
  (as `torchrun --standalone`); two runs at once never collide;
- OMP_NUM_THREADS = usable cores // processes (at least 1) unless the user set it; PYTHONUNBUFFERED=1 so
  that rank 0 streams live;
- multi-node: `--node-rank 0` / `N` become `is_host=1` / `0` for the c10d store unless `--rdzv-conf` says,
  and the interface for gloo and nccl comes from `--network-interface` or `--local-addr`
  (`collective_interface`);
- torch's agent logs every step at WARNING: quiet unless `--verbose` (the header and summary say it better).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from lockstep.errors import ConfigError
from lockstep.launch.flag_values import parse_endpoint
from lockstep.launch.spec import LaunchSpec

_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# The agent sets this in the launcher's own environment and never unsets it.
_AGENT_SIGNALS_VAR = "TORCHELASTIC_SIGNALS_TO_HANDLE"


def make_run_dir(requested: str | None, cwd: str) -> str:
    """The run directory: the one asked for, or a fresh ./runs/<YYYYmmdd-HHMMSS>-<id>."""
    if requested:
        path = os.path.abspath(os.path.join(cwd, requested))
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create --run-dir {requested!r} ({exc.strerror}); pick a writable directory"
            ) from None
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
    return (
        str(threads),
        f"OMP_NUM_THREADS={threads} ({cores} cores / {spec.nproc_per_node} process{'es' if spec.nproc_per_node != 1 else ''})",
    )


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
    hosting = is_host in ("1", "true", "yes") or (
        is_host == "" and host in (*_LOCAL_HOSTS, socket.gethostname())
    )
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


def launch_config(spec: LaunchSpec, run_dir: str, rdzv_conf: dict[str, Any], on_attempt: Any) -> Any:
    """torch's LaunchConfig for `spec`: per-rank logs in `run_dir` announced to `on_attempt` (a
    rank_logs.OnAttempt), and, for c10d, torch's rendezvous plus the attempt number every node agrees on."""
    from torch.distributed.launcher.api import LaunchConfig

    from lockstep.launch import rendezvous
    from lockstep.launch.rank_logs import RunDirLogs

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


def worker_env(spec: LaunchSpec, threads: str, interface: str | None) -> dict[str, str]:
    """The variables every worker gets on top of the launcher's environment (`--env` wins)."""
    env = {"OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    if spec.hang_timeout is not None:
        from lockstep.runtime.env.env_contract import (
            HANG_TIMEOUT_VAR,  # lockstep.runtime loads torch: only now
        )

        env[HANG_TIMEOUT_VAR] = f"{spec.hang_timeout:g}"
    if spec.evict_stragglers is not None:
        from lockstep.runtime.env.env_contract import EVICT_STRAGGLERS_VAR

        env[EVICT_STRAGGLERS_VAR] = f"{spec.evict_stragglers:g}"
    if interface:
        for name in _IFNAME_VARS:
            env[name] = spec.network_interface or os.environ.get(name) or interface
    env.update(spec.env)
    if spec.ddp == "lockstep":
        from lockstep.startup import python_path  # stdlib only: the engine loads in the workers, not here

        env["PYTHONPATH"] = python_path(env.get("PYTHONPATH", os.environ.get("PYTHONPATH")))
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
def worker_environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Workers inherit the launcher's environment: set `extra` for the duration of the launch only."""
    touched = [*extra, _AGENT_SIGNALS_VAR]
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
def quiet_agent_logs(verbose: bool) -> Iterator[None]:
    """torch's agent logs every step at WARNING; our header and summary say it better, unless --verbose.
    torch sets a level on each of its module loggers, so each one is raised (and restored) here."""
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401  (creates its logger)
    import torch.distributed.launcher.api  # noqa: F401

    names = [
        name
        for name in logging.root.manager.loggerDict
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))
    ]
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
