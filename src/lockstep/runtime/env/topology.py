"""Pure mapping from an environment (torchrun, SLURM, explicit arguments or nothing) to a Topology.

This is the one module of the library (besides launch/) that reads environment variables, and it reads
them only from the mapping it is given, so every rule here is unit-testable without touching os.environ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lockstep.errors import ConfigError
from lockstep.runtime.env.env_contract import (
    AGENT_STORE_ON,
    AGENT_STORE_VAR,
    ATTEMPT_VAR,
    EVICT_STRAGGLERS_VAR,
    GROUP_RANK_VAR,
    HANG_TIMEOUT_VAR,
    LIVE_JOIN_VAR,
    LIVE_MIN_WORLD_VAR,
    LOCAL_RANK_VAR,
    LOCAL_WORLD_SIZE_VAR,
    MASTER_ADDR_VAR,
    MASTER_PORT_VAR,
    MEMBER_ID_VAR,
    RANK_VAR,
    REPORT_DIR_VAR,
    RESTART_COUNT_VAR,
    TORCHRUN_VARS,
    WORLD_SIZE_VAR,
)
from lockstep.runtime.env.slurm_notation import expand_hostlist, expand_tasks_per_node, slurm_port

SLURM_PSEUDO_STEPS = (
    "batch",
    "extern",
    "interactive",
    "4294967291",
    "4294967292",
    "4294967293",
    "4294967294",
)


@dataclass(frozen=True)
class Topology:
    """Facts about this process's place in the job. `is_main` means global rank 0.

    A description only: it owns nothing. The process group's lifetime belongs to runtime/process_group.py
    (`with lockstep.init():` leaves the group on exit only where that init() call formed it).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    launcher: str = "none"  # one of: none, explicit, torchrun, slurm
    # Set under torch's elastic agent, which hosts the store: the restart attempt this process belongs to.
    agent_store_attempt: int | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def __str__(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
            f"node {self.node_rank}/{self.num_nodes}) via {self.launcher}, endpoint {self.endpoint}"
        )


def detect_launcher(env: Mapping[str, str]) -> str:
    """Which launcher started this process: torchrun (or lockstep run), slurm, or none."""
    if "TORCHELASTIC_RUN_ID" in env or (RANK_VAR in env or WORLD_SIZE_VAR in env or LOCAL_RANK_VAR in env):
        return "torchrun"
    # Only inside an `srun` step: the batch script itself also has SLURM_PROCID=0 and SLURM_NTASKS=N,
    # and treating it as rank 0 of N would wait forever for ranks that never start.
    in_step = "SLURM_STEP_NUM_TASKS" in env or env.get("SLURM_STEP_ID", "") not in ("", *SLURM_PSEUDO_STEPS)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and in_step:
        return "slurm"
    return "none"


def resolve_topology(
    env: Mapping[str, str],
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> Topology:
    """Build the Topology from explicit arguments, torchrun's variables, SLURM's, or a world of 1.

    Explicit `rank`/`world_size` (the tutorials' `setup(rank, world_size)`) win; then torchrun's
    RANK/WORLD_SIZE; then an `srun` step's SLURM_* variables; else this is a world of 1.
    """
    if rank is not None or world_size is not None:
        return _from_explicit(env, rank, world_size)
    launcher = detect_launcher(env)
    if launcher == "torchrun":
        return _from_torchrun(env)
    if launcher == "slurm":
        return _from_slurm(env)
    return Topology()


def _int_var(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is not set; it is required here")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _check_rank(rank: int, world_size: int, what: str) -> None:
    if world_size < 1:
        raise ConfigError(f"world size is {world_size} ({what}); it must be at least 1")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"rank {rank} is outside the world of {world_size} processes ({what}); "
            f"ranks run from 0 to {world_size - 1}: check the rank and world size you pass"
        )


def _master_port(env: Mapping[str, str], default: int) -> int:
    port = _int_var(env, MASTER_PORT_VAR, default)
    if not 0 <= port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port (0-65535)")
    return port


def _from_explicit(env: Mapping[str, str], rank: int | None, world_size: int | None) -> Topology:
    if rank is None or world_size is None:
        raise ConfigError(
            f"got rank={rank!r} and world_size={world_size!r}; pass both or neither "
            "(neither reads them from torchrun or SLURM, or runs a world of 1)"
        )
    _check_rank(rank, world_size, "from the arguments")
    if world_size > 1 and (MASTER_ADDR_VAR not in env or MASTER_PORT_VAR not in env):
        raise ConfigError(
            f"rank {rank} of {world_size} was given explicitly but MASTER_ADDR/MASTER_PORT are not set; "
            "set both (e.g. os.environ['MASTER_ADDR'] = '127.0.0.1'; os.environ['MASTER_PORT'] = '29500') "
            "or start the script with `lockstep run -n N`"
        )
    local_world = _int_var(env, LOCAL_WORLD_SIZE_VAR, world_size)
    return Topology(
        rank=rank,
        local_rank=_int_var(env, LOCAL_RANK_VAR, rank % local_world),
        world_size=world_size,
        local_world_size=local_world,
        node_rank=_int_var(env, GROUP_RANK_VAR, rank // local_world),
        num_nodes=max(1, world_size // local_world),
        master_addr=env.get(MASTER_ADDR_VAR, "127.0.0.1"),
        master_port=_master_port(env, 0),
        launcher="explicit",
    )


def _from_torchrun(env: Mapping[str, str]) -> Topology:
    missing = [name for name in (RANK_VAR, WORLD_SIZE_VAR) if name not in env]
    if missing:
        present = {name: env[name] for name in TORCHRUN_VARS if name in env}
        raise ConfigError(
            f"partial launcher environment: {present!r} is set but {', '.join(missing)} is missing; "
            "set RANK and WORLD_SIZE together (and MASTER_ADDR/MASTER_PORT), or start the script with "
            "`lockstep run -n N` / torchrun, or unset them all to run a world of 1"
        )
    world_size = _int_var(env, WORLD_SIZE_VAR)
    rank = _int_var(env, RANK_VAR)
    _check_rank(rank, world_size, "from RANK/WORLD_SIZE")
    local_world = _int_var(env, LOCAL_WORLD_SIZE_VAR, world_size)
    local_rank = _int_var(env, LOCAL_RANK_VAR, rank % local_world)
    _check_rank(local_rank, local_world, "from LOCAL_RANK/LOCAL_WORLD_SIZE")
    if world_size > 1 and MASTER_ADDR_VAR not in env:
        raise ConfigError(
            f"RANK={rank} WORLD_SIZE={world_size} are set but MASTER_ADDR is not; "
            "set MASTER_ADDR and MASTER_PORT, or start the script with `lockstep run -n N`"
        )
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world,
        node_rank=_int_var(env, GROUP_RANK_VAR, rank // local_world),
        num_nodes=max(1, -(-world_size // local_world)),
        master_addr=env.get(MASTER_ADDR_VAR, "127.0.0.1"),
        master_port=_master_port(env, 29500),
        launcher="torchrun",
        agent_store_attempt=_agent_store_attempt(env),
    )


def _agent_store_attempt(env: Mapping[str, str]) -> int | None:
    """Under torch's elastic agent (which hosts the store): the attempt this process belongs to.

    ATTEMPT_VAR (set by `lockstep run`) is the job's attempt, the same on every node; under plain torchrun
    only RESTART_COUNT_VAR exists (this node's own restarts). runtime/env/env_contract.py says why they differ.
    """
    if env.get(AGENT_STORE_VAR) != AGENT_STORE_ON:
        return None
    if env.get(ATTEMPT_VAR, "") != "":
        return _int_var(env, ATTEMPT_VAR)
    return _int_var(env, RESTART_COUNT_VAR, 0)


def _from_slurm(env: Mapping[str, str]) -> Topology:
    world_size = _int_var(env, "SLURM_STEP_NUM_TASKS", _int_var(env, "SLURM_NTASKS"))
    rank = _int_var(env, "SLURM_PROCID")
    _check_rank(rank, world_size, "from SLURM_PROCID/SLURM_NTASKS")
    node_rank = _int_var(env, "SLURM_NODEID", 0)
    tasks_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world_size)
    per_node = expand_tasks_per_node(tasks_spec)
    local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if MASTER_ADDR_VAR in env:
        master_addr = env[MASTER_ADDR_VAR]
    elif nodelist:
        master_addr = expand_hostlist(nodelist)[0]
    else:
        raise ConfigError(
            f"SLURM task {rank} of {world_size}: neither MASTER_ADDR nor SLURM_NODELIST is set, "
            "so the head node is unknown; export MASTER_ADDR in the batch script"
        )
    job_id = _int_var(env, "SLURM_JOB_ID", 0)
    return Topology(
        rank=rank,
        local_rank=_int_var(env, "SLURM_LOCALID", 0),
        world_size=world_size,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=_int_var(env, "SLURM_STEP_NUM_NODES", _int_var(env, "SLURM_NNODES", len(per_node))),
        master_addr=master_addr,
        master_port=_master_port(env, slurm_port(job_id)),
        launcher="slurm",
    )


DEFAULT_HANG_TIMEOUT = 300.0  # seconds: well below torch's 30 minutes, above any sane straggler


def hang_timeout_from_env(environ: Mapping[str, str]) -> float:
    """The hang watchdog's timeout: LOCKSTEP_HANG_TIMEOUT (seconds, 0 = off), else DEFAULT_HANG_TIMEOUT."""
    raw = environ.get(HANG_TIMEOUT_VAR, "").strip()
    if not raw:
        return DEFAULT_HANG_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(
            f"{HANG_TIMEOUT_VAR}={raw!r} is not a number of seconds >= 0; set it like "
            f"{HANG_TIMEOUT_VAR}=300 (0 turns the hang watchdog off)"
        )
    return value


def evict_stragglers_from_env(environ: Mapping[str, str]) -> float | None:
    """`--evict-stragglers FACTOR` (live mode): the factor, None when not set."""
    raw = environ.get(EVICT_STRAGGLERS_VAR, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 1:
        raise ConfigError(
            f"{EVICT_STRAGGLERS_VAR}={raw!r} is not a factor > 1; set it like {EVICT_STRAGGLERS_VAR}=2 "
            "(`lockstep run --evict-stragglers 2`)"
        )
    return value


def report_dir_from_env(environ: Mapping[str, str]) -> str | None:
    """Where `lockstep run` wants the hang report (None: print it to stderr on every rank)."""
    return environ.get(REPORT_DIR_VAR) or None


@dataclass(frozen=True)
class LiveSettings:
    """Live mode, as `lockstep run --min-world M` sets it up for a worker (runtime/membership/)."""

    min_world: int
    member_id: int | None  # this worker's id in the job (None: its RANK)
    joining: bool  # a replacement: it queues for admission and receives its state from a peer
    attempt: int = 0  # whole-job restarts before this one (a job-ending error, launch/live_account.py)


def live_settings_from_env(environ: Mapping[str, str]) -> LiveSettings | None:
    """Live mode's settings, None when the job is not in live mode."""
    raw = environ.get(LIVE_MIN_WORLD_VAR, "")
    if not raw:
        return None
    member = environ.get(MEMBER_ID_VAR)
    return LiveSettings(
        min_world=int(raw),
        member_id=int(member) if member else None,
        joining=environ.get(LIVE_JOIN_VAR) == "1",
        attempt=_int_var(environ, ATTEMPT_VAR, 0),
    )
