"""SLURM's own notations: compressed host and task lists, and the port that a job's ranks meet on.

Pure string arithmetic, shared by runtime/env/topology.py (which reads an `srun` step's variables) and
launch/slurm/slurm.py (whose sbatch script computes the same port in shell: `slurm_port` is its contract).
"""

from __future__ import annotations

import re

from lockstep.errors import ConfigError

# A job's rendezvous port: derived from its id, so that two jobs sharing a head node rarely collide.
SLURM_BASE_PORT = 15000
SLURM_PORT_SPAN = 20000


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
    close_at = item.find("]", open_at)
    if close_at < 0:  # a "]" before the "[" passes the bracket count of _split_top_level
        raise ConfigError(
            f"unbalanced brackets in SLURM node list entry {item!r}; expected e.g. 'gpu[01-03]'"
        )
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
