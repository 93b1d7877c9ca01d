"""Which network interface holds an address: so that `--local-addr` alone is enough for gloo and nccl.

Across nodes, gloo and nccl pick the address they tell their peers from the host name unless
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name an interface; where the host name resolves to 127.0.0.1
(common in containers and network namespaces) every peer is told to connect to itself, and the job hangs
until the init timeout. A node started with `--local-addr A` has said which address is its own on the shared
network, so the interface that holds A is the one to use. Linux only (SIOCGIFADDR); None elsewhere.
"""

from __future__ import annotations

import socket
import struct

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def interface_addresses() -> dict[str, str]:
    """{interface name: its IPv4 address} for the interfaces that have one (empty where this cannot be asked)."""
    try:
        import fcntl

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):
        return {}
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it (or it went away)
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def interface_for(address: str) -> str | None:
    """The interface whose IPv4 address is `address` (a name is resolved first), or None."""
    try:
        wanted = socket.gethostbyname(address)
    except OSError:
        return None
    for name, addr in interface_addresses().items():
        if addr == wanted:
            return name
    return None
