"""Machine checks and package installs shared by the testbed fixtures (root, apt, commands on PATH)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

APT_TIMEOUT = 300.0


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def missing(commands: tuple[str, ...]) -> list[str]:
    return [cmd for cmd in commands if shutil.which(cmd) is None]


def ensure_commands(commands: tuple[str, ...], packages: tuple[str, ...]) -> str | None:
    """Install `packages` with apt when one of `commands` is missing; return why not possible, or None."""
    if not missing(commands):
        return None
    if not is_root():
        return f"needs {', '.join(missing(commands))} (Debian packages {' '.join(packages)}) and is not root"
    if shutil.which("apt-get") is None:
        return f"needs {', '.join(missing(commands))} and apt-get is not available to install {' '.join(packages)}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=APT_TIMEOUT)
    if result.returncode != 0:
        # A stale package index is the usual cause on a fresh CI machine: refresh it once and retry.
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env, timeout=APT_TIMEOUT)
        result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=APT_TIMEOUT)
    if result.returncode != 0 or missing(commands):
        return f"apt-get install {' '.join(packages)} failed (rc {result.returncode}): {result.stderr[-400:]}"
    return None


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
