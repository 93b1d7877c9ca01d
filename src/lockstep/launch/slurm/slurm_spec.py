"""What one `lockstep slurm` submission asks for (`SlurmSpec`), checked when it is made.

launch/slurm/slurm.py builds it from the command line and submits the script that launch/slurm/slurm_script.py
renders from it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from lockstep.errors import ConfigError

REQUEUE_FALLBACK_MARGIN = (
    10  # seconds before the limit at which a step that ignored SIGUSR1 is requeued anyway
)
SCRIPT_NAME = "sbatch.sh"
DEFAULT_SIGNAL_BEFORE = 120
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


@dataclass(frozen=True)
class SlurmSpec:
    """One `lockstep slurm` submission. Paths are absolute; `python` is the interpreter the nodes run."""

    script: str
    run_dir: str
    workdir: str
    python: str
    args: tuple[str, ...] = ()
    nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    job_name: str | None = None
    requeue: bool = False
    signal_before: int = DEFAULT_SIGNAL_BEFORE
    network_interface: str | None = None
    max_restarts: int = 0

    def __post_init__(self) -> None:
        validate(self)

    @property
    def name(self) -> str:
        return self.job_name or os.path.splitext(os.path.basename(self.script))[0] or "lockstep"

    @property
    def script_path(self) -> str:
        return os.path.join(self.run_dir, SCRIPT_NAME)

    @property
    def output_pattern(self) -> str:
        """Where SLURM writes the batch output (every node's `lockstep run` console): %j is the job id."""
        return os.path.join(self.run_dir, "slurm-%j.out")


def validate(spec: SlurmSpec) -> None:
    """Raise ConfigError naming the flag to fix when `spec` cannot make a runnable job."""
    for flag, value, minimum in (
        ("--nodes", spec.nodes, 1),
        ("-n/--nproc-per-node", spec.nproc_per_node, 1),
        ("--gpus-per-node", spec.gpus_per_node, 0),
        ("--cpus-per-task", spec.cpus_per_task, 1),
        ("--signal-before", spec.signal_before, 1),
        ("--max-restarts", spec.max_restarts, 0),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
            raise ConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")
    if spec.gpus_per_node and spec.nproc_per_node > spec.gpus_per_node:
        raise ConfigError(
            f"-n {spec.nproc_per_node} processes per node but --gpus-per-node {spec.gpus_per_node}: each process "
            f"drives one GPU; pass -n {spec.gpus_per_node} (or leave -n out), or ask for --gpus-per-node "
            f"{spec.nproc_per_node}"
        )
    limit = time_limit_seconds(spec.time) if spec.time is not None else None
    if spec.requeue and limit is not None and spec.signal_before + REQUEUE_FALLBACK_MARGIN >= limit:
        raise ConfigError(
            f"--signal-before {spec.signal_before} s does not fit in --time {spec.time!r} ({limit} s): the "
            f"checkpoint signal must come at least {REQUEUE_FALLBACK_MARGIN} s after the start; "
            "use a longer --time or a smaller --signal-before"
        )
    for flag, name in (
        ("--partition", spec.partition),
        ("--account", spec.account),
        ("--job-name", spec.job_name),
    ):
        if name is not None and (not name or any(c.isspace() for c in name)):
            raise ConfigError(f"{flag} {name!r} must be a non-empty name without spaces")
    if not spec.script:
        raise ConfigError(
            "no script given; name the training script, e.g. `lockstep slurm --nodes 2 train.py`"
        )


def time_limit_seconds(text: str) -> int:
    """SLURM's --time forms (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) -> seconds; ConfigError otherwise."""
    match = _TIME_RE.match(text.strip())
    if not match:
        raise ConfigError(
            f"--time {text!r} is not a SLURM time limit; use MINUTES, HH:MM:SS or D-HH:MM:SS, e.g. 2:00:00"
        )
    days, a, b, c = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # D-H, D-H:M, D-H:M:S
        return days * 86400 + (a or 0) * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return (a or 0) * 3600 + (b or 0) * 60 + c
    if b is not None:  # M:S
        return (a or 0) * 60 + b
    return (a or 0) * 60  # M
