"""What `lockstep run` should start and how: the LaunchSpec, its command-line parser and its validation.

Pure: parsing and checking only, no process is started and nothing outside the given arguments is read
(except `check_entrypoint`, which looks for the script on disk). Flag names follow torchrun where they
overlap (`-n/--nproc-per-node`, `--nnodes`, `--node-rank`, `--rdzv-endpoint`, `--rdzv-id`,
`--max-restarts`, `-m`), with torchrun's underscore spellings accepted too. Everything after the script
(or the `-m` module) is the script's own argv, passed through untouched. The flags' values are parsed
by launch/flag_values.py.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from lockstep.errors import ConfigError
from lockstep.launch.flag_values import (
    DEFAULT_RDZV_PORT,
    factor_flag,
    int_flag,
    parse_endpoint,
    parse_key_values,
    parse_nnodes,
    seconds_flag,
)

STANDALONE_ENDPOINT = "127.0.0.1:0"  # port 0: the kernel picks a free port atomically when the store binds
LOG_MODES = ("rank0", "all")
RDZV_BACKENDS = ("c10d", "static")
DDP_ENGINES = ("torch", "lockstep")  # --ddp: whose DistributedDataParallel torch's names give the workers


@dataclass(frozen=True)
class LaunchSpec:
    """Everything `lockstep.launch.local.launch` needs to start one node's workers.

    `entrypoint` is a script path, or a module name when `module` is true (`-m`); `args` are its own
    arguments. `rdzv_endpoint=None` means single node on a kernel-chosen free port (`--standalone`).
    `run_dir=None` means a fresh `./runs/<timestamp>-<id>` directory. `env` is added to each worker's
    environment.
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    module: bool = False
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    network_interface: str | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1
    run_dir: str | None = None
    logs: str = "rank0"
    env: Mapping[str, str] = field(default_factory=dict)
    shutdown_grace: float = 5.0
    verbose: bool = False
    hang_timeout: float | None = None  # None: the workers' default (LOCKSTEP_HANG_TIMEOUT, else 300 s)
    min_world: int | None = None  # live mode (launch/live_launch.py): survivors go on while this many remain
    evict_stragglers: float | None = None  # live mode: evict a rank this many times slower than the others
    ddp: str = "torch"  # "lockstep": torch's DDP names give lockstep's class (lockstep/startup)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def is_multi_node(self) -> bool:
        return self.max_nodes > 1

    @property
    def endpoint(self) -> str:
        """The rendezvous endpoint: the user's, or 127.0.0.1:0 for a single node."""
        return self.rdzv_endpoint or STANDALONE_ENDPOINT


def validate(spec: LaunchSpec) -> None:
    """Raise ConfigError naming the flag to fix when `spec` cannot describe a runnable job."""
    if not spec.entrypoint:
        raise ConfigError("no script given; name the script to run, e.g. `lockstep run -n 2 train.py`")
    _check_int("-n/--nproc-per-node", spec.nproc_per_node, minimum=1, example="-n 2")
    _check_int("--nnodes", spec.min_nodes, minimum=1, example="--nnodes 2")
    if spec.max_nodes < spec.min_nodes:
        raise ConfigError(
            f"--nnodes {spec.min_nodes}:{spec.max_nodes} has MIN > MAX; write MIN:MAX with MIN <= MAX"
        )
    _check_int("--max-restarts", spec.max_restarts, minimum=0, example="--max-restarts 0")
    if spec.node_rank is not None and not 0 <= spec.node_rank < spec.max_nodes:
        raise ConfigError(
            f"--node-rank {spec.node_rank} is outside 0..{spec.max_nodes - 1} for --nnodes {spec.max_nodes}; "
            "number the nodes from 0 (the node that hosts the rendezvous is 0)"
        )
    if not spec.monitor_interval > 0:
        raise ConfigError(
            f"--monitor-interval must be a positive number of seconds, got {spec.monitor_interval!r}"
        )
    if spec.hang_timeout is not None and not spec.hang_timeout >= 0:
        raise ConfigError(
            f"--hang-timeout must be a number of seconds >= 0 (0 turns the hang watchdog off), "
            f"got {spec.hang_timeout!r}; e.g. --hang-timeout 300"
        )
    if spec.min_world is not None:
        _check_live(spec)
    if spec.evict_stragglers is not None:
        _check_eviction(spec)
    if spec.shutdown_grace < 0:
        raise ConfigError(f"shutdown_grace must be >= 0 seconds, got {spec.shutdown_grace!r}")
    if spec.logs not in LOG_MODES:
        raise ConfigError(f"--logs {spec.logs!r} is not one of {', '.join(LOG_MODES)}")
    if spec.ddp not in DDP_ENGINES:
        raise ConfigError(f"--ddp {spec.ddp!r} is not one of {', '.join(DDP_ENGINES)}")
    if spec.rdzv_backend not in RDZV_BACKENDS:
        raise ConfigError(f"--rdzv-backend {spec.rdzv_backend!r} is not one of {', '.join(RDZV_BACKENDS)}")
    if spec.is_multi_node and not spec.rdzv_endpoint:
        raise ConfigError(
            f"--nnodes {spec.max_nodes} needs --rdzv-endpoint HOST:PORT, the address of the node that hosts the "
            "rendezvous (the same on every node), e.g. --rdzv-endpoint 10.0.0.1:29400"
        )
    if spec.rdzv_endpoint is not None:
        host, port = parse_endpoint(spec.rdzv_endpoint)
        if port == 0 and spec.is_multi_node:
            raise ConfigError(
                f"--rdzv-endpoint {spec.rdzv_endpoint!r} has port 0, but the other nodes must know the port; "
                f"pick a fixed free port, e.g. {host}:{DEFAULT_RDZV_PORT}"
            )
    if spec.rdzv_backend == "static" and spec.is_multi_node and spec.node_rank is None:
        raise ConfigError("--rdzv-backend static needs --node-rank on every node (0 on the head node)")
    for key in spec.env:
        if not key or "=" in key:
            raise ConfigError(f"environment variable name {key!r} is not valid; use --env NAME=VALUE")


def _check_int(flag: str, value: object, *, minimum: int, example: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}; e.g. {example}")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError (exit code 2 in the CLI) instead of exiting from inside a library."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def build_parser(prog: str = "lockstep run") -> argparse.ArgumentParser:
    """The `lockstep run` parser; its flags are pinned by tests/unit/test_public_api.py."""
    parser = _Parser(
        prog=prog,
        allow_abbrev=False,
        description="Start N processes of a training script on this node (or on several nodes) with torch's "
        "elastic agent. Rank 0 prints here; every rank's output is in the run directory.",
        usage="%(prog)s [options] (SCRIPT | -m MODULE) [script args...]",
    )
    add = parser.add_argument
    add(
        "-n",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        default="1",
        metavar="N",
        help="processes on this node (default 1)",
    )
    add("--nnodes", default="1", metavar="N|MIN:MAX", help="number of nodes (default 1)")
    add(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        default=None,
        help="this node's index; 0 hosts the rendezvous store (default: decided by the rendezvous)",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous address of the head node (required with --nnodes > 1; default: 127.0.0.1, free port)",
    )
    add("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None, help="job id, the same on every node")
    add("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="c10d", choices=RDZV_BACKENDS)
    add(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="rendezvous settings, e.g. is_host=1,join_timeout=600",
    )
    add("--standalone", action="store_true", help="single node on a free port (the default for one node)")
    add(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        default=None,
        help="this node's address as the other nodes see it",
    )
    add(
        "--network-interface",
        dest="network_interface",
        default=None,
        metavar="IFNAME",
        help="network interface for collectives (sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME)",
    )
    add("--max-restarts", "--max_restarts", dest="max_restarts", default=0)
    add(
        "--min-world",
        dest="min_world",
        default=None,
        metavar="M",
        help="live mode: when a rank dies the others go on without a restart, re-forming the group among "
        "themselves, while at least M remain; with --max-restarts R, up to R replacements join at a step "
        "boundary and take their state from a peer",
    )
    add(
        "--evict-stragglers",
        dest="evict_stragglers",
        default=None,
        metavar="FACTOR",
        help="live mode: a rank whose busy time per step stays FACTOR (> 1) times the other ranks' is "
        "evicted as if it had failed, and the others go on (the fault record says why)",
    )
    add("--monitor-interval", "--monitor_interval", dest="monitor_interval", default=0.1, metavar="SECONDS")
    add(
        "--hang-timeout",
        dest="hang_timeout",
        default=None,
        metavar="SECONDS",
        help="end the job with a report naming the stuck rank when a rank waits this long in a collective "
        "(default 300; 0: off)",
    )
    add(
        "--run-dir",
        "--log-dir",
        "--log_dir",
        dest="run_dir",
        default=None,
        help="where per-rank logs go (default ./runs/<timestamp>-<id>)",
    )
    add(
        "--logs",
        choices=LOG_MODES,
        default="rank0",
        help="rank0: rank 0's output plus other ranks' warnings and errors (default); all: every rank, prefixed",
    )
    add(
        "--env",
        dest="env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment variable for every worker (repeatable)",
    )
    add(
        "--ddp",
        choices=DDP_ENGINES,
        default="torch",
        help="whose DistributedDataParallel the program gets where it asks for torch's: torch (default, "
        "nothing replaced) or lockstep (lockstep's engine under torch's names, also inside Hugging Face "
        "Trainer, Lightning and Accelerate; docs/frameworks.md)",
    )
    add("--verbose", action="store_true", help="also show torch's elastic agent log")
    add("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    add("script", nargs="?", default=None, help="the training script (or module with -m)")
    add("script_args", nargs=argparse.REMAINDER, help="arguments for the script, passed through untouched")
    return parser


def parse_run_args(argv: Sequence[str], prog: str = "lockstep run") -> LaunchSpec:
    """`lockstep run` argv (without 'run') -> LaunchSpec; ConfigError with the flag to fix on bad input."""
    ns = build_parser(prog).parse_args(list(argv))
    if ns.script is None:
        raise ConfigError(
            "no script given; name the script to run, e.g. `lockstep run -n 2 train.py`, "
            "or a module with -m, e.g. `lockstep run -n 2 -m mypkg.train`"
        )
    try:
        nproc = int(ns.nproc_per_node)
    except ValueError:
        raise ConfigError(
            f"-n/--nproc-per-node must be an integer >= 1, got {ns.nproc_per_node!r}; e.g. -n 2"
        ) from None
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    if ns.standalone and max_nodes > 1:
        raise ConfigError(f"--standalone is for one node but --nnodes is {ns.nnodes!r}; drop one of them")
    return LaunchSpec(
        entrypoint=ns.script,
        args=tuple(ns.script_args),
        module=ns.module,
        nproc_per_node=nproc,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=int_flag(ns.node_rank, "--node-rank", prog),
        rdzv_backend=ns.rdzv_backend,
        rdzv_endpoint=None if ns.standalone else ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        rdzv_conf=parse_key_values(ns.rdzv_conf, "--rdzv-conf"),
        local_addr=ns.local_addr,
        network_interface=ns.network_interface,
        max_restarts=int_flag(ns.max_restarts, "--max-restarts", prog) or 0,
        monitor_interval=seconds_flag(ns.monitor_interval, "--monitor-interval", prog),
        hang_timeout=seconds_flag(ns.hang_timeout, "--hang-timeout", prog) if ns.hang_timeout else None,
        run_dir=ns.run_dir,
        logs=ns.logs,
        env=parse_key_values(ns.env, "--env"),
        verbose=ns.verbose,
        min_world=int_flag(ns.min_world, "--min-world", prog),
        evict_stragglers=factor_flag(ns.evict_stragglers, "--evict-stragglers", prog),
        ddp=ns.ddp,
    )


def _check_live(spec: LaunchSpec) -> None:
    _check_int("--min-world", spec.min_world, minimum=1, example="--min-world 2")
    started = spec.nproc_per_node * spec.max_nodes
    if spec.min_world is not None and spec.min_world > started:
        where = f" on {spec.max_nodes} nodes" if spec.is_multi_node else ""
        raise ConfigError(
            f"--min-world {spec.min_world} is more than the {started} processes started (-n){where}; "
            f"choose at most {started}"
        )
    if spec.min_nodes != spec.max_nodes:
        raise ConfigError(
            f"--min-world (live mode) needs a fixed number of nodes, got --nnodes {spec.min_nodes}:"
            f"{spec.max_nodes}; write --nnodes {spec.max_nodes} (the job itself goes on with fewer ranks)"
        )
    if spec.is_multi_node and spec.node_rank is None:
        raise ConfigError(
            "--min-world on several nodes needs --node-rank I on each node (0 on the node that hosts the store "
            "at --rdzv-endpoint)"
        )


def _check_eviction(spec: LaunchSpec) -> None:
    factor = spec.evict_stragglers
    if not (isinstance(factor, (int, float)) and factor > 1):
        raise ConfigError(
            f"--evict-stragglers must be a factor > 1 (how many times slower than the others a rank must stay "
            f"to be evicted), got {factor!r}; e.g. --evict-stragglers 2"
        )
    if spec.min_world is None:
        raise ConfigError(
            "--evict-stragglers needs live mode, where the others go on without the evicted rank: add "
            "--min-world M (at most the ranks started minus one)"
        )


def check_entrypoint(spec: LaunchSpec, cwd: str) -> None:
    """Raise ConfigError when the script file (or the module's top-level package) cannot be found."""
    if spec.module:
        top = spec.entrypoint.split(".")[0]
        # Workers run with the launch directory first on sys.path, as `python -m` does.
        if (
            not top.isidentifier()
            or importlib.machinery.PathFinder.find_spec(top, [cwd, *_sys_path()]) is None
        ):
            raise ConfigError(
                f"module {spec.entrypoint!r} (-m) was not found: no package {top!r} in {cwd!r} or on sys.path; "
                "check the name, or install the package"
            )
        return
    path = os.path.join(cwd, spec.entrypoint)
    if not os.path.exists(path):
        raise ConfigError(
            f"script {spec.entrypoint!r} not found (looked in {cwd!r}); check the path, "
            "or pass a module with -m, e.g. `lockstep run -n 2 -m mypkg.train`"
        )
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "__main__.py")):
        raise ConfigError(
            f"{spec.entrypoint!r} is a directory without __main__.py; name the script inside it"
        )


def _sys_path() -> list[str]:
    return [p for p in sys.path if p]
