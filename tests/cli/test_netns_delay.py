"""The delaying wire of testbed/netns.py: two namespace hosts, 10 ms each way, at 100 Mbit/s.

The kernel here has no netem; netns_hosts(2, delay_ms=D) joins the hosts through a userspace AF_PACKET
forwarder in a middle namespace (testbed/wire.py). Checked: an ICMP round trip takes about 2 D,
bytes cross intact both ways through tbf and the wire, the forwarder and the namespaces are gone after the
block, also when the block raises, and the forwarder dies with a process SIGKILLed before its cleanup could
run. Skipped, with the reason, only where the machine cannot create namespaces (not root, no iproute2).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest

from lockstep.errors import ConfigError
from testbed.netns import netns_hosts, ping_ms, teardown, unavailable_reason, wire_pids
from tests.helpers import child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

DELAY_MS = 10.0

ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); data = b""
while len(data) < int(sys.argv[2]):
    data += c.recv(1 << 20)
c.sendall(data[::-1]); c.close()
"""
CLIENT = """
import hashlib, socket, sys
payload = hashlib.sha256(b"lockstep").digest() * (int(sys.argv[3]) // 32)
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); c.sendall(payload); back = b""
while len(back) < len(payload):
    back += c.recv(1 << 20)
print("intact" if back == payload[::-1] else "corrupt")
"""


@pytest.fixture(scope="module", autouse=True)
def namespaces_possible() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no network-namespace hosts on this machine: {reason}")


def alive(pid: int) -> bool:
    """A process that still exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_round_trip_is_twice_the_delay_and_the_wire_goes_away() -> None:
    with netns_hosts(2, rate="100mbit", delay_ms=DELAY_MS) as (a, b):
        pids = wire_pids([a, b])
        ping_ms(a, b.addr, 1)  # ARP resolution: its extra round trip is not the link's
        rtts = ping_ms(a, b.addr, 10)
        size = 4 * 1024 * 1024
        server = b.popen(
            [sys.executable, "-c", ECHO_SERVER, b.addr, str(size)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        client = a.run([sys.executable, "-c", CLIENT, b.addr, port, str(size)], timeout=60)
        server.communicate(timeout=30)
        names = (a.netns, b.netns)
    assert len(pids) == 1, pids  # the forwarder, inside the wire's namespace
    # One-way DELAY_MS each direction: netem's `delay 10ms` on both hosts gives a 20 ms round trip.
    assert len(rtts) == 10 and 2 * DELAY_MS - 1 <= min(rtts), rtts
    assert 1.8 * DELAY_MS <= statistics.median(rtts) <= 4 * DELAY_MS, rtts
    assert client.stdout.strip() == "intact", (client.stdout, client.stderr)
    assert not [pid for pid in pids if alive(pid)], pids
    assert not [name for name in names if name in namespaces()]


def test_the_wire_is_killed_when_the_block_raises() -> None:
    with (
        pytest.raises(RuntimeError, match="the benchmark failed"),
        netns_hosts(2, delay_ms=DELAY_MS) as hosts,
    ):
        pids = wire_pids(hosts)
        raise RuntimeError("the benchmark failed")
    assert pids and not [pid for pid in pids if alive(pid)], pids
    assert hosts[0].netns not in namespaces()


HOLDER = """
import sys, time
import testbed.netns as netns
with netns.netns_hosts(2, delay_ms=10) as hosts:
    print(" ".join([hosts[0].netns, hosts[1].netns, *map(str, netns.wire_pids(hosts))]), flush=True)
    time.sleep(120)
"""


def test_the_wire_dies_with_a_process_killed_before_its_cleanup() -> None:
    """SIGKILL runs no `finally`: the forwarder goes by itself (PR_SET_PDEATHSIG); the namespaces stay (the
    same as without a delay), and this test removes them."""
    env = child_env(PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout is not None
    first, second, *pids = holder.stdout.readline().split()
    wire = "lsw" + first[len("lsh") :].split("n")[0]
    try:
        assert pids, "the holder saw no forwarder"
        holder.kill()
        holder.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(int(pid)) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in pids if alive(int(pid))], pids
    finally:
        holder.kill()
        teardown([wire, first, second])


@pytest.mark.parametrize(("count", "delay"), [(3, 10.0), (2, -1.0)])
def test_a_delay_needs_two_hosts_and_a_positive_value(count: int, delay: float) -> None:
    before = namespaces()
    with pytest.raises(ConfigError, match="delay_ms"), netns_hosts(count, delay_ms=delay):
        pass
    assert namespaces() == before  # refused before anything was made
