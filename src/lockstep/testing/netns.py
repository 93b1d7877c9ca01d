"""Several "hosts" on one machine: network namespaces joined by a bridge, with an optional tc rate limit.

For tests and benchmarks of multi-node jobs (tests/cli/test_multinode.py, benchmarks/multinode.py). Needs
root, iproute2 (ip, tc) and util-linux (nsenter).

    with netns_hosts(2, rate="1gbit") as (a, b):
        server = a.popen(["python", "train.py"], env={"MASTER_ADDR": a.addr, ...})
        b.run(["python", "train.py"], env=...)

Layout: a "switch" namespace holds a Linux bridge; each host namespace has one veth (`IFNAME`, address
10.X.Y.(i+1)/24) whose peer is a port of that bridge, and `lo` up. Nothing is added to the machine's own
network namespace, and the 10.X.Y.0/24 subnet is private to these namespaces (X, Y random per instance, so
that concurrent test runs never share one). A rate limit is a `tc tbf` on each host's veth egress (the
kernel here has tbf and htb but no netem: there is no added latency).

Commands enter a host with `nsenter --net=/run/netns/NAME` (unlike `ip netns exec`, it leaves /sys as it
is). Cleanup, always (also when the test fails): SIGKILL every process still inside the namespaces this
instance created (`ip netns pids`: only processes the test started there), then delete the namespaces,
which removes their veths and the bridge.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from lockstep.errors import ConfigError, NetnsError

IFNAME = "lsnet0"
COMMANDS = ("ip", "tc", "nsenter")
PACKAGES = ("iproute2", "util-linux")  # the Debian packages that hold COMMANDS


def unavailable_reason() -> str | None:
    """Why this machine cannot host namespace "hosts" (root, the commands, a kernel with netns), or None."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        return "network namespaces need root (ip netns add); run as root"
    absent = [cmd for cmd in COMMANDS if shutil.which(cmd) is None]
    if absent:
        return f"{', '.join(absent)} not found on PATH (Debian packages {' '.join(PACKAGES)})"
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
def netns_hosts(count: int = 2, *, rate: str | None = None) -> Iterator[list[Host]]:
    """Create `count` hosts on one bridge (optionally rate-limited); yield them; always tear everything down."""
    tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
    switch = f"lssw{tag}"
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
    hosts = [Host(netns=f"lsh{tag}n{i}", addr=f"{subnet}.{i + 1}") for i in range(count)]
    created: list[str] = []
    try:
        _ip("netns", "add", switch)
        created.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            _ip("netns", "add", host.netns)
            created.append(host.netns)
            port = f"p{i}"
            _ip(
                "-n", switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", host.netns
            )
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
            _ip("-n", host.netns, "link", "set", IFNAME, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            shape(host, rate)
        yield hosts
    finally:
        teardown(created)


def teardown(namespaces: Sequence[str]) -> None:
    """SIGKILL what the test left running inside `namespaces`, then delete them (veths and bridge go too)."""
    for name in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for name in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
