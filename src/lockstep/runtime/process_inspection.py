"""Look at a process without asking it: Python stacks of this one, and whether a peer on this host still runs.

The hang watchdog (runtime/watchdog.py) publishes the main thread's stack every tick and every thread's in
its final state, and tells a peer that stopped answering apart from one that is stopped (SIGSTOP, a
debugger) or gone, by reading /proc when the peer runs on this host. Nothing here reads source files or
talks to a peer: it is cheap enough for every tick.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import Any


def format_stack(frame: Any, limit: int = 24) -> list[str]:
    """The innermost `limit` frames, outermost first, without reading source files (cheap every tick)."""
    out: list[str] = []
    while frame is not None and len(out) < limit:
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return out[::-1]


def all_stacks() -> dict[str, list[str]]:
    """Every thread's stack, keyed by its name and ident."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        f"{names.get(ident, 'thread')} ({ident})": format_stack(frame)
        for ident, frame in sys._current_frames().items()
    }


def process_state(pid: int) -> str | None:
    """The state letter of a process on this host (R, S, D, T, Z...), None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


_SWITCHES = ("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")


def times_switched(pid: int) -> int | None:
    """How many times a process on this host was switched out so far (its main thread's voluntary and
    involuntary context switches), None when there is none. Stopping a process and starting it again moves
    the count, so two looks that see it stopped with one count saw one stop, however far apart they were."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            counts = [int(line.split()[1]) for line in fh if line.startswith(_SWITCHES)]
    except (OSError, ValueError, IndexError):
        return None
    return sum(counts) if counts else None


@functools.cache
def proc_view() -> str:
    """Which processes this one's /proc shows: its machine's boot id and its pid namespace ("" where there
    is no /proc). A peer's pid names the same process here only if the peer published the same view: two
    containers sharing a hostname (host networking) have pid namespaces of their own, and two machines can
    share a hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return f"{fh.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def seen_here(state: dict[str, Any], my_host: str) -> bool:
    """Whether this process's /proc shows the peer whose heartbeat (or whereabouts) is `state`."""
    view = proc_view()
    return (
        bool(view) and state.get("host") == my_host and state.get("view") == view and bool(state.get("pid"))
    )


def gone(state: dict[str, Any], my_host: str) -> str | None:
    """Why a rank on this host cannot answer (stopped or dead), None when it can or is elsewhere (another
    host, or another pid namespace: `seen_here`). `state` is the rank's last heartbeat (host, view, pid)."""
    if not seen_here(state, my_host) or state.get("exited"):
        return None
    pid = int(state["pid"])
    status = process_state(pid)
    if status is None:
        return f"dead: its process (pid {pid}) no longer exists"
    if status in ("Z", "X"):
        return f"dead: its process (pid {pid}) has exited"
    if status in ("T", "t"):
        return f"stopped: its process (pid {pid}) is stopped (SIGSTOP or a debugger)"
    return None


def liveness(state: dict[str, Any], unchanged: float) -> str:
    """How a rank whose heartbeat has not changed for `unchanged` seconds is described."""
    pid, host = state.get("pid"), state.get("host", "?")
    if state.get("beat", -1) < 0:
        return f"not responding: it never published a heartbeat in {unchanged:.1f} s"
    return f"not responding: no heartbeat for {unchanged:.1f} s (host {host}, pid {pid})"
