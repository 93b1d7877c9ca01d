"""Network-namespace "hosts" for the multi-host tests: lockstep.testing.netns, with this repo's set-up step.

The harness itself (Host, netns_hosts, shape, teardown) lives in lockstep.testing.netns, where the benchmarks
use it too; this module adds the skip reason that names `make testbed` when its commands are missing.
"""

from __future__ import annotations

from lockstep.testing import netns as _netns
from lockstep.testing.netns import (
    IFNAME,
    Host,
    netns_hosts,
    ping_ms,
    rate_bits,
    shape,
    teardown,
    wire_cpu_seconds,
    wire_pids,
)
from tests.testbed.system import is_root, require_commands

__all__ = [
    "COMMANDS",
    "IFNAME",
    "PACKAGES",
    "Host",
    "netns_hosts",
    "ping_ms",
    "rate_bits",
    "shape",
    "teardown",
    "unavailable_reason",
    "wire_cpu_seconds",
    "wire_pids",
]

COMMANDS = _netns.COMMANDS
PACKAGES = _netns.PACKAGES  # installed by `make testbed` (Makefile: TESTBED_PACKAGES)


def unavailable_reason() -> str | None:
    """Why this machine cannot host namespace "hosts" (root, iproute2, a kernel with netns and veth)."""
    if not is_root():
        return "network namespaces need root (ip netns add); run the tests as root"
    return require_commands(COMMANDS, PACKAGES) or _netns.unavailable_reason()
