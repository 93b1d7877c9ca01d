"""What the hang watchdog reads of its peers: a process on this host seen stopped or gone in /proc, and when
live mode may name such a peer lost without waiting out the hang timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from lockstep.runtime.peer_heartbeats import STOPPED_GRACE, PeerHeartbeats, surely_lost


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(timeout=30)


def _published(store: dist.Store, rank: int, pid: int, age_s: float, **extra: object) -> None:
    beat = {"rank": rank, "beat": 7, "host": socket.gethostname(), "pid": pid, "t": time.time() - age_s}
    store.set(f"hb/{rank}", json.dumps({**beat, **extra}))


def _wait_for_state(pid: int, letters: str) -> None:
    for _ in range(500):
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] in letters:
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached a state in {letters!r}")


def test_a_stopped_peer_is_away_and_surely_lost_only_once_its_heartbeat_is_old_enough(
    child: subprocess.Popen[bytes],
) -> None:
    store = dist.HashStore()
    os.kill(child.pid, signal.SIGSTOP)
    _wait_for_state(child.pid, "Tt")
    _published(store, 1, child.pid, age_s=0.2)
    state = PeerHeartbeats(0, 2, socket.gethostname(), stale_after=2.0).read(store)[1]
    assert state["away"].startswith(f"stopped: its process (pid {child.pid}) is stopped"), state
    assert state["silent"] and state["liveness"] == state["away"]
    now = time.time()
    assert surely_lost(state, now, stopped_for=1.5) is None  # stopped 0.2 s: a py-spy dump, maybe
    assert surely_lost(state, now + 1.5, stopped_for=1.5) == state["away"]
    heartbeats = PeerHeartbeats(0, 2, socket.gethostname(), stale_after=2.0)
    assert heartbeats.surely_lost(store, tick=0.5) == {}  # its last beat: 0.2 s old, under STOPPED_GRACE
    _published(store, 1, child.pid, age_s=STOPPED_GRACE + 0.6)
    assert heartbeats.surely_lost(store, tick=0.5) == {1: state["away"]}
    os.kill(child.pid, signal.SIGCONT)
    _wait_for_state(child.pid, "RS")
    state = PeerHeartbeats(0, 2, socket.gethostname(), stale_after=2.0).read(store)[1]
    assert "away" not in state and surely_lost(state, now + 10, stopped_for=1.5) is None, state


def test_a_gone_peer_is_away_but_left_to_its_launcher_and_one_that_exited_cleanly_is_neither(
    child: subprocess.Popen[bytes],
) -> None:
    """A dead process is marked away (the report says so), but not surely lost: its launcher marks it dead
    within milliseconds and knows its signal ("killed by SIGKILL"), which a survivor's eviction would hide."""
    store = dist.HashStore()
    child.kill()
    child.wait(timeout=30)
    _published(store, 1, child.pid, age_s=5.0)
    _published(store, 2, child.pid, age_s=5.0, exited=True)
    _published(store, 3, os.getpid(), age_s=30.0)  # alive and running: silence alone is not certainty
    heartbeats = PeerHeartbeats(0, 4, socket.gethostname(), stale_after=2.0)
    states = heartbeats.read(store)
    assert states[1]["away"] == f"dead: its process (pid {child.pid}) no longer exists", states[1]
    assert states[1]["silent"] and "away" not in states[2] and "away" not in states[3]
    now = time.time()
    assert all(surely_lost(states[r], now, stopped_for=1.5) is None for r in (1, 2, 3))
    assert heartbeats.surely_lost(store, tick=0.5) == {}


def test_a_peer_on_another_host_is_never_judged_by_this_hosts_proc(child: subprocess.Popen[bytes]) -> None:
    store = dist.HashStore()
    os.kill(child.pid, signal.SIGSTOP)
    _wait_for_state(child.pid, "Tt")
    store.set("hb/1", json.dumps({"rank": 1, "beat": 1, "host": "elsewhere", "pid": child.pid, "t": 0.0}))
    state = PeerHeartbeats(0, 2, socket.gethostname(), stale_after=2.0).read(store)[1]
    assert "away" not in state and surely_lost(state, time.time(), stopped_for=1.5) is None
