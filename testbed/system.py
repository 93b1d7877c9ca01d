"""Machine checks shared by the testbed fixtures: root, and the commands that `make testbed` installs.

The fixtures never install anything themselves: the SLURM and multi-host tiers need Debian packages
(slurm-wlm, munge, iproute2, util-linux) that one documented set-up step installs, as root, once:
`make testbed` (the Makefile holds the package list; `.ci/run` runs it). Without them, those tests skip
with a reason that names that command.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

SETUP_COMMAND = "make testbed"


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def missing(commands: tuple[str, ...]) -> list[str]:
    return [cmd for cmd in commands if shutil.which(cmd) is None]


def require_commands(commands: tuple[str, ...], packages: tuple[str, ...]) -> str | None:
    """Why a fixture cannot run when one of `commands` is not on PATH (the skip reason), or None."""
    absent = missing(commands)
    if not absent:
        return None
    return (
        f"{', '.join(absent)} not found on PATH (Debian packages {' '.join(packages)}); "
        f"run `{SETUP_COMMAND}` as root once to install them"
    )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc), e.g. the daemon an `unshare --fork` wrapper started."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except (OSError, ValueError):
        return []


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 5.0) -> None:
    """Stop a process this harness started, by its own handle: SIGTERM to it (and, for an `unshare --fork`
    wrapper, which ignores SIGTERM, to the daemon it forked), wait `grace` seconds, then SIGKILL."""
    if proc.poll() is not None:
        return
    for pid in [proc.pid, *children(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()  # `unshare --kill-child` then SIGKILLs its child, and with it the whole PID namespace
        proc.wait(timeout=grace)
