"""Several "hosts" on one machine: network namespaces on a bridge, with an optional rate limit and delay.

The test bed's, for tests and benchmarks of multi-node jobs (tests/cli/test_multinode.py,
benchmarks/multinode.py: the benchmarks put the repository root on sys.path to import it). Needs root,
iproute2 (ip, tc) and util-linux (nsenter): `make testbed` installs them, and `unavailable_reason()` is the
skip reason that says so.

    with netns_hosts(2, rate="1gbit") as (a, b):
        server = a.popen(["python", "train.py"], env={"MASTER_ADDR": a.addr, ...})
        b.run(["python", "train.py"], env=...)

Layout: a "switch" namespace holds a Linux bridge; each host namespace has one veth (`IFNAME`, address
10.X.Y.(i+1)/24) whose peer is a port of that bridge, and `lo` up. Nothing is added to the machine's own
network namespace, and the 10.X.Y.0/24 subnet is private to these namespaces (X, Y random per instance, so
that concurrent test runs never share one). A rate limit is a `tc tbf` on each host's veth egress.

A delay (`delay_ms`, two hosts only): the kernel here has tbf and htb but no netem, so latency cannot come
from tc. Instead of the bridge, the middle namespace ("wire") holds the two veth peers and runs
testbed/wire.py, a userspace forwarder that sends every frame out of the other side `delay_ms`
after it arrived: `delay_ms` one way in each direction, a round trip of 2 x delay_ms, as netem's `delay`
on each host's egress would give. The tbf stays on the hosts' egress, before the wire. Measured here
(benchmarks/results/2026-11-26-link_delay.md, 100 Mbit/s, 10 ms): ping 20.3-20.6 ms median, TCP and
gloo at about 93 and 86 Mbit/s, the forwarder 7-13% of a core while the link is busy. `ping_ms` measures a
round trip (an ICMP raw socket: no ping binary needed), `wire_cpu_seconds` the forwarder's CPU.

Commands enter a host with `nsenter --net=/run/netns/NAME` (unlike `ip netns exec`, it leaves /sys as it
is). Cleanup, always (also when the test fails): SIGKILL every process still inside the namespaces this
instance created (`ip netns pids`: only processes the test started there, and the wire's forwarder, which
is first asked to stop with SIGTERM), then delete the namespaces, which removes their veths and the
bridge. The forwarder also dies with the process that started it (PR_SET_PDEATHSIG), when that one is
killed before its cleanup can run.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lockstep.errors import ConfigError, InternalError, NetnsError
from testbed.system import is_root, require_commands

IFNAME = "lsnet0"
COMMANDS = ("ip", "tc", "nsenter")
PACKAGES = ("iproute2", "util-linux")  # the Debian packages that hold COMMANDS (Makefile: TESTBED_PACKAGES)


def unavailable_reason() -> str | None:
    """Why this machine cannot host namespace "hosts" (root, the commands `make testbed` installs, a kernel
    with netns and veth), or None."""
    if not is_root():
        return "network namespaces need root (ip netns add); run the tests as root"
    absent = require_commands(COMMANDS, PACKAGES)
    if absent:
        return absent
    probe = f"lsprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    """One namespace "host": its namespace name, its address on the shared subnet and its interface."""

    netns: str
    addr: str
    ifname: str = IFNAME

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", *argv]

    def free_port(self) -> int:
        """A TCP port free on this host's address, chosen by its kernel (a socket bound to port 0 inside
        the namespace): for a rendezvous endpoint that a test or benchmark must name before it starts."""
        code = f"import socket; s = socket.socket(); s.bind(({self.addr!r}, 0)); print(s.getsockname()[1])"
        out = self.run([sys.executable, "-c", code], timeout=60)
        if out.returncode != 0:
            raise NetnsError(f"no free port on {self.netns} ({self.addr}): {out.stderr.strip()}")
        return int(out.stdout)

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[str]:
        """Start `argv` inside this host (its own session, so a hung job can be killed as a group)."""
        return subprocess.Popen(
            self.command(argv),
            env={**os.environ, **(env or {})},
            cwd=cwd,
            text=True,
            start_new_session=True,
            **kwargs,
        )  # type: ignore[call-overload]

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(argv),
            env={**os.environ, **(env or {})},
            cwd=cwd,
            text=True,
            capture_output=True,
            timeout=timeout,
        )


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed (exit {result.returncode}): {result.stderr.strip()}")


def _tc(netns: str, *args: str) -> None:
    result = subprocess.run(["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NetnsError(
            f"`tc {' '.join(args)}` in {netns} failed (exit {result.returncode}): {result.stderr.strip()}"
        )


def rate_bits(rate: str) -> int:
    """'10gbit' / '1gbit' / '100mbit' -> bits per second (tc's units)."""
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ConfigError(f"rate {rate!r} is not a tc rate; expected a number with a unit, like 1gbit or 100mbit")


def shape(host: Host, rate: str | None) -> None:
    """Limit `host`'s egress to `rate` with a token bucket (or remove the limit when rate is None)."""
    subprocess.run(
        ["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", host.ifname, "root"],
        capture_output=True,
    )
    if rate is None:
        return
    # A 1 ms bucket (at least a few packets): a larger one lets short transfers pass faster than the limit
    # (with 10 ms, a 1 MB all-reduce measured 2.8x the 1 Gbit/s limit); tbf times its queue with hrtimers.
    burst = max(32 * 1024, rate_bits(rate) // 8 // 1000)
    _tc(
        host.netns,
        "qdisc",
        "add",
        "dev",
        host.ifname,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        str(burst),
        "latency",
        "100ms",
    )


@contextlib.contextmanager
def netns_hosts(count: int = 2, *, rate: str | None = None, delay_ms: float = 0.0) -> Iterator[list[Host]]:
    """Create `count` hosts on one bridge (optionally rate-limited); yield them; always tear everything down.

    delay_ms > 0 (two hosts only): join them by a delaying wire instead of the bridge (see the module's
    docstring): each direction `delay_ms` late, a round trip of 2 x delay_ms."""
    if delay_ms < 0 or (delay_ms > 0 and count != 2):
        raise ConfigError(
            f"delay_ms={delay_ms!r} with count={count!r}: a delay needs delay_ms > 0 and exactly 2 hosts "
            "(the wire joins two interfaces); use delay_ms=0 for a bridge of any size"
        )
    tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
    middle = f"lsw{tag}" if delay_ms else f"lssw{tag}"
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
    hosts = [Host(netns=f"lsh{tag}n{i}", addr=f"{subnet}.{i + 1}") for i in range(count)]
    created: list[str] = []
    forwarder: subprocess.Popen[str] | None = None
    try:
        _ip("netns", "add", middle)
        created.append(middle)
        if not delay_ms:
            _ip("-n", middle, "link", "add", "br0", "type", "bridge")
            _ip("-n", middle, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            _ip("netns", "add", host.netns)
            created.append(host.netns)
            port = f"p{i}"
            _ip(
                "-n", middle, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", host.netns
            )
            if not delay_ms:
                _ip("-n", middle, "link", "set", port, "master", "br0")
            _ip("-n", middle, "link", "set", port, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
            _ip("-n", host.netns, "link", "set", IFNAME, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            shape(host, rate)
        if delay_ms:
            forwarder = _start_wire(middle, delay_ms)
        yield hosts
    finally:
        if forwarder is not None:
            _stop(forwarder)
        teardown(created)


def _start_wire(netns: str, delay_ms: float) -> subprocess.Popen[str]:
    """Run testbed/wire.py inside `netns` between p0 and p1 (by its path: it imports nothing of
    lockstep or torch); return once its sockets are open."""
    argv = [sys.executable, str(Path(__file__).with_name("wire.py")), "--delay-ms", str(delay_ms), "p0", "p1"]
    proc = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{netns}", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.stdout is None:  # stdout=PIPE was asked for: never
        raise InternalError("lockstep bug: the wire forwarder was started without a pipe for its stdout")
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        _stop(proc)
        raise NetnsError(
            f"the delaying wire in {netns} did not start (said {line.strip()!r}): "
            f"{(proc.stderr.read() if proc.stderr else '')[-2000:]}"
        )
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM the wire (it prints its counters), SIGKILL it after 5 s; reap it either way."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.communicate(timeout=5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def wire_pids(hosts: Sequence[Host]) -> list[int]:
    """The processes running in the delaying wire's namespace between `hosts` (none: no wire, or gone)."""
    wire = "lsw" + hosts[0].netns[len("lsh") :].split("n")[0]
    pids = subprocess.run(["ip", "netns", "pids", wire], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in pids]


def wire_cpu_seconds(hosts: Sequence[Host]) -> float:
    """CPU seconds (user + system) used so far by the delaying wire between `hosts` (0.0 with no wire)."""
    total = 0
    for pid in wire_pids(hosts):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


_PING = """
import socket, struct, sys, time
dst, count = sys.argv[1], int(sys.argv[2])
sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
sock.settimeout(2.0)
def checksum(data):
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF
for seq in range(count):
    body = struct.pack("!d", time.monotonic()) + bytes(48)
    head = struct.pack("!BBHHH", 8, 0, 0, 0x4C53, seq)
    sock.sendto(struct.pack("!BBHHH", 8, 0, checksum(head + body), 0x4C53, seq) + body, (dst, 0))
    start = time.monotonic()
    while True:
        reply, (src, _) = sock.recvfrom(2048)
        icmp = reply[(reply[0] & 15) * 4 :]
        if src == dst and icmp[0] == 0 and struct.unpack("!HH", icmp[4:8]) == (0x4C53, seq):
            print(f"{(time.monotonic() - start) * 1000:.3f}", flush=True)
            break
    time.sleep(0.05)
"""


def ping_ms(host: Host, addr: str, count: int = 10) -> list[float]:
    """Round-trip times in ms of `count` ICMP echoes from `host` to `addr` (a raw socket: no ping binary)."""
    out = host.run([sys.executable, "-c", _PING, addr, str(count)], timeout=10.0 + 3.0 * count)
    if out.returncode != 0:
        raise NetnsError(f"ping from {host.netns} to {addr} failed: {out.stderr.strip()[-2000:]}")
    return [float(line) for line in out.stdout.split()]


def teardown(namespaces: Sequence[str]) -> None:
    """SIGKILL what the test left running inside `namespaces`, then delete them (veths and bridge go too)."""
    for name in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for name in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
