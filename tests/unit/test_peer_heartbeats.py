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
from datetime import timedelta

import pytest
import torch.distributed as dist

from lockstep.runtime.peer_heartbeats import PeerHeartbeats
from lockstep.runtime.process_inspection import proc_view
from tests.helpers import wait_for_state


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(timeout=30)


def _published(store: dist.Store, rank: int, pid: int, age_s: float, **extra: object) -> None:
    beat = {"rank": rank, "beat": 7, "host": socket.gethostname(), "view": proc_view(), "pid": pid}
    beat["t"] = time.time() - age_s
    store.set(f"hb/{rank}", json.dumps({**beat, **extra}))


def test_a_stopped_peer_is_surely_lost_only_once_seen_stopped_at_every_read_for_the_grace(
    child: subprocess.Popen[bytes],
) -> None:
    store = dist.HashStore()
    os.kill(child.pid, signal.SIGSTOP)
    wait_for_state(child.pid, "Tt")
    _published(store, 1, child.pid, age_s=30.0)  # an old heartbeat is no proof of a long stop
    heartbeats = PeerHeartbeats(0, 2, socket.gethostname(), stale_after=2.0)
    assert heartbeats.surely_lost(store, grace=0.3) == {}  # first seen stopped now: a py-spy dump, maybe
    state = heartbeats.read(store)[1]
    assert state["away"].startswith(f"stopped: its process (pid {child.pid}) is stopped"), state
    assert state["silent"] and state["liveness"] == state["away"]
    time.sleep(0.35)
    assert heartbeats.surely_lost(store, grace=0.3) == {1: state["away"]}
    os.kill(child.pid, signal.SIGCONT)  # running again, then stopped again: its clock starts anew
    wait_for_state(child.pid, "RS")
    assert heartbeats.surely_lost(store, grace=0.0) == {}
    os.kill(child.pid, signal.SIGSTOP)
    wait_for_state(child.pid, "Tt")
    assert heartbeats.surely_lost(store, grace=0.3) == {}
    _published(store, 1, child.pid, age_s=0.0, beat=8)  # a new heartbeat: it ran in between, unseen
    time.sleep(0.35)
    assert heartbeats.surely_lost(store, grace=0.3) == {}
    os.kill(child.pid, signal.SIGCONT)  # started and stopped again between two looks, one heartbeat: its
    wait_for_state(child.pid, "RS")  # count of context switches moved, so the clock starts anew
    os.kill(child.pid, signal.SIGSTOP)
    wait_for_state(child.pid, "Tt")
    time.sleep(0.35)
    assert heartbeats.surely_lost(store, grace=0.3) == {}
    time.sleep(0.35)
    assert heartbeats.surely_lost(store, grace=0.3) == {1: state["away"]}


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
    assert heartbeats.surely_lost(store, grace=0.0) == {}


def test_a_peer_on_another_host_or_in_another_pid_namespace_is_never_judged_by_this_proc(
    child: subprocess.Popen[bytes],
) -> None:
    """Its pid names another process here, or none: another host, or a container that shares this hostname
    (host networking) but has a pid namespace of its own (its heartbeat's `view`)."""
    store = dist.HashStore()
    os.kill(child.pid, signal.SIGSTOP)
    wait_for_state(child.pid, "Tt")
    store.set("hb/1", json.dumps({"rank": 1, "beat": 1, "host": "elsewhere", "pid": child.pid, "t": 0.0}))
    _published(store, 2, child.pid, age_s=0.0, view="0123-boot/pid:[4026532999]")
    heartbeats = PeerHeartbeats(0, 3, socket.gethostname(), stale_after=2.0)
    states = heartbeats.read(store)
    assert "away" not in states[1] and "away" not in states[2], states
    assert heartbeats.surely_lost(store, grace=0.0) == {}
    assert proc_view().endswith(os.readlink("/proc/self/ns/pid")), proc_view()


def test_once_placed_a_running_peer_costs_no_store_read_and_a_stopped_one_its_heartbeat_alone(
    child: subprocess.Popen[bytes],
) -> None:
    """surely_lost runs at every tick of every wait: after one read of each peer's heartbeat (its host and
    pid), it reads /proc, and the store only for a peer seen stopped. A heartbeat deleted from the store
    shows which it still reads: a read of a missing key fails after the store's timeout."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    _published(store, 1, os.getpid(), age_s=0.0)  # running, on this host
    _published(store, 2, child.pid, age_s=0.0)  # to be stopped, on this host
    store.set("hb/3", json.dumps({"rank": 3, "beat": 1, "host": "elsewhere", "pid": child.pid, "t": 0.0}))
    heartbeats = PeerHeartbeats(0, 4, socket.gethostname(), stale_after=2.0)
    assert heartbeats.surely_lost(store, grace=0.0) == {}  # places all three
    for rank in (1, 3):
        store.delete_key(f"hb/{rank}")
    assert heartbeats.surely_lost(store, grace=0.0) == {}  # neither is read again
    os.kill(child.pid, signal.SIGSTOP)
    wait_for_state(child.pid, "Tt")
    lost = heartbeats.surely_lost(store, grace=0.0)
    assert list(lost) == [2] and lost[2].startswith(f"stopped: its process (pid {child.pid})"), lost
    store.delete_key("hb/2")
    with pytest.raises(dist.DistStoreError, match="timeout"):  # a stopped peer's heartbeat is read
        heartbeats.surely_lost(store, grace=0.0)
