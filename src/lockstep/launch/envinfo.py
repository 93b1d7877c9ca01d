"""`lockstep env`: what a user pastes into a bug report (versions, backends, devices, threads, topology).

`collect(env)` gathers the facts into a plain dict (JSON-ready, `lockstep env --json`); `render` prints
them as aligned lines. The launcher and Topology come from lockstep.runtime.env.topology, from the mapping
given, so an inconsistent environment shows its error message instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from lockstep.errors import ConfigError

# Variables that decide how a job starts; shown when set.
_RELEVANT_PREFIXES = ("SLURM_", "TORCHELASTIC_", "NCCL_", "GLOO_", "TORCH_DISTRIBUTED", "LOCKSTEP_")
# With runtime/env/env_contract.TORCHRUN_VARS and CUDA_VISIBLE_DEVICES_VAR (read in `collect`: they load torch).
_RELEVANT_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED")
_SLURM_SHOWN = (
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NODEID",
    "SLURM_NNODES",
    "SLURM_STEP_ID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_TASKS_PER_NODE",
)


def collect(env: Mapping[str, str]) -> dict[str, Any]:
    """Gather the report from `env` (normally os.environ) and from this process's torch."""
    import torch
    import torch.distributed as dist

    from lockstep import __version__
    from lockstep.runtime.env.env_contract import CUDA_VISIBLE_DEVICES_VAR, TORCHRUN_VARS
    from lockstep.runtime.env.topology import detect_launcher, resolve_topology

    info: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        "lockstep": f"{__version__} ({os.path.dirname(os.path.abspath(_lockstep_file()))})",
        "numpy": _version("numpy"),
        "backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "devices": _devices(torch),
        "threads": {
            "cores_usable": _usable_cores(),
            "cores_total": os.cpu_count(),
            "torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "unset"),
            "MKL_NUM_THREADS": env.get("MKL_NUM_THREADS", "unset"),
        },
    }
    info["launcher"] = detect_launcher(env)
    try:
        info["topology"] = str(resolve_topology(env))
    except ConfigError as exc:
        info["topology"] = f"ERROR: {exc}"
    names = {*TORCHRUN_VARS, CUDA_VISIBLE_DEVICES_VAR, *_RELEVANT_NAMES}
    info["env"] = {key: env[key] for key in sorted(env) if _relevant(key, names)}
    return info


def _relevant(key: str, names: set[str]) -> bool:
    if key.startswith("SLURM_"):
        return key in _SLURM_SHOWN
    return key in names or key.startswith(_RELEVANT_PREFIXES)


def _lockstep_file() -> str:
    # The package's own file, found through a module this layer may import (lockstep/errors.py).
    return getattr(sys.modules[ConfigError.__module__], "__file__", None) or ""


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed, or broken metadata: the report must still print
        return "not installed"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _devices(torch: Any) -> dict[str, Any]:
    devices: dict[str, Any] = {"cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        devices["cuda"] = [f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    else:
        devices["cuda"] = "not available"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices["mps"] = "available"
    return devices


def render(info: Mapping[str, Any]) -> str:
    """The report as `name: value` lines, nested dicts flattened as `a=b, c=d`."""
    lines = []
    for key, value in info.items():
        if isinstance(value, Mapping):
            shown = ", ".join(f"{k}={_short(v)}" for k, v in value.items()) or "(none)"
        elif isinstance(value, list):
            shown = "; ".join(str(v) for v in value)
        else:
            shown = str(value)
        lines.append(f"{key + ':':<12} {shown}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return "; ".join(str(v) for v in value)
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    """`lockstep env [--json]`."""
    parser = argparse.ArgumentParser(
        prog="lockstep env", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(list(argv or []))
    info = collect(os.environ)
    sys.stdout.write((json.dumps(info, indent=2) if args.json else render(info)) + "\n")
    return 0
