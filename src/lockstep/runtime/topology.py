"""Pure mapping from an environment (torchrun, SLURM, explicit arguments or nothing) to a Topology.

This is the one module of the library (besides launch/) that reads environment variables, and it reads
them only from the mapping it is given, so every rule here is unit-testable without touching os.environ.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep.errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_BASE_PORT = 15000
SLURM_PORT_SPAN = 20000
SLURM_PSEUDO_STEPS = ("batch", "extern", "interactive", "4294967291", "4294967292", "4294967293", "4294967294")


@dataclass(frozen=True)
class Topology:
    """Facts about this process's place in the job. `is_main` means global rank 0."""

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

    # `with lockstep.init() as topo:` shuts the process group down on exit.
    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: Any) -> None:
        from lockstep.runtime.process_group import shutdown

        shutdown()


def detect_launcher(env: Mapping[str, str]) -> str:
    """Which launcher started this process: torchrun (or lockstep run), slurm, or none."""
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env or "WORLD_SIZE" in env or "LOCAL_RANK" in env):
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
    port = _int_var(env, "MASTER_PORT", default)
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
    if world_size > 1 and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
        raise ConfigError(
            f"rank {rank} of {world_size} was given explicitly but MASTER_ADDR/MASTER_PORT are not set; "
            "set both (e.g. os.environ['MASTER_ADDR'] = '127.0.0.1'; os.environ['MASTER_PORT'] = '29500') "
            "or start the script with `lockstep run -n N`"
        )
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", world_size)
    return Topology(
        rank=rank,
        local_rank=_int_var(env, "LOCAL_RANK", rank % local_world),
        world_size=world_size,
        local_world_size=local_world,
        node_rank=_int_var(env, "GROUP_RANK", rank // local_world),
        num_nodes=max(1, world_size // local_world),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_master_port(env, 0),
        launcher="explicit",
    )


def _from_torchrun(env: Mapping[str, str]) -> Topology:
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in env]
    if missing:
        present = {name: env[name] for name in TORCHRUN_VARS if name in env}
        raise ConfigError(
            f"partial launcher environment: {present!r} is set but {', '.join(missing)} is missing; "
            "set RANK and WORLD_SIZE together (and MASTER_ADDR/MASTER_PORT), or start the script with "
            "`lockstep run -n N` / torchrun, or unset them all to run a world of 1"
        )
    world_size = _int_var(env, "WORLD_SIZE")
    rank = _int_var(env, "RANK")
    _check_rank(rank, world_size, "from RANK/WORLD_SIZE")
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", world_size)
    local_rank = _int_var(env, "LOCAL_RANK", rank % local_world)
    _check_rank(local_rank, local_world, "from LOCAL_RANK/LOCAL_WORLD_SIZE")
    if world_size > 1 and "MASTER_ADDR" not in env:
        raise ConfigError(
            f"RANK={rank} WORLD_SIZE={world_size} are set but MASTER_ADDR is not; "
            "set MASTER_ADDR and MASTER_PORT, or start the script with `lockstep run -n N`"
        )
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world,
        node_rank=_int_var(env, "GROUP_RANK", rank // local_world),
        num_nodes=max(1, -(-world_size // local_world)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_master_port(env, 29500),
        launcher="torchrun",
        agent_store_attempt=_agent_store_attempt(env),
    )


def _agent_store_attempt(env: Mapping[str, str]) -> int | None:
    """Under torch's elastic agent (which hosts the store): the attempt this process belongs to.

    LOCKSTEP_ATTEMPT (set by `lockstep run`) is the job's attempt, the same on every node. Under plain
    torchrun only TORCHELASTIC_RESTART_COUNT exists; it counts this node's own restarts, which is the
    job's attempt on one node but not across nodes once a peer restarted for a failure of its own.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if env.get("LOCKSTEP_ATTEMPT", "") != "":
        return _int_var(env, "LOCKSTEP_ATTEMPT")
    return _int_var(env, "TORCHELASTIC_RESTART_COUNT", 0)


def _from_slurm(env: Mapping[str, str]) -> Topology:
    world_size = _int_var(env, "SLURM_STEP_NUM_TASKS", _int_var(env, "SLURM_NTASKS"))
    rank = _int_var(env, "SLURM_PROCID")
    _check_rank(rank, world_size, "from SLURM_PROCID/SLURM_NTASKS")
    node_rank = _int_var(env, "SLURM_NODEID", 0)
    tasks_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world_size)
    per_node = expand_tasks_per_node(tasks_spec)
    local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if "MASTER_ADDR" in env:
        master_addr = env["MASTER_ADDR"]
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


def slurm_port(job_id: int) -> int:
    """A port derived from the job id, so that two jobs sharing a head node rarely collide."""
    return SLURM_BASE_PORT + job_id % SLURM_PORT_SPAN


_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's compressed tasks-per-node list: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = _TASKS_RE.match(part.strip())
        if not match:
            raise ConfigError(f"cannot parse SLURM tasks-per-node {spec!r} (expected e.g. '2(x3),1')")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist: 'gpu[01-03,07],login1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        hosts.extend(_expand_host(item))
    if not hosts:
        raise ConfigError(f"SLURM node list {hostlist!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    if depth != 0:
        raise ConfigError(f"unbalanced brackets in SLURM node list {text!r}")
    return [part.strip() for part in parts if part.strip()]


def _expand_host(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, ranges, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_host(rest) if rest else [""]
    hosts: list[str] = []
    for piece in ranges.split(","):
        lo, _, hi = piece.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError(f"cannot parse range {piece!r} in SLURM node list entry {item!r}")
        width = len(lo)
        for number in range(int(lo), int(hi or lo) + 1):
            hosts.extend(f"{prefix}{number:0{width}d}{tail}" for tail in tails)
    return hosts
