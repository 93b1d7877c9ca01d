"""A delaying wire: forward Ethernet frames between two interfaces, each one `delay_ms` after it arrived.

The kernel here has no netem, so testbed/netns.py adds latency in userspace: the two hosts' veth
peers live in a middle "wire" namespace, and this program (run there, stdlib only, started by file path so
that it imports nothing of lockstep or torch) reads every frame from one side with an AF_PACKET raw socket
and sends it out of the other side after the delay: one FIFO queue per direction, stamped at arrival, so
the order within a direction is kept. A one-way delay D on both directions gives a round trip of 2 D, as
netem's `delay D` on each host's egress would.

Offloads pass through instead of being turned off: both sockets use PACKET_VNET_HDR, so a frame arrives
with its virtio-net header (a GSO super-frame's segment size, a checksum the sender left to the device)
and leaves with the same header; the kernel segments and checksums on the far side as a NIC would. The
rate limit stays where it is, a tc tbf on each host's egress, before the wire.

    python wire.py --delay-ms 10 IFACE_A IFACE_B

It ends on SIGTERM/SIGINT, and with SIGKILL when its parent dies (PR_SET_PDEATHSIG): the process that
made the namespaces never leaves it behind. On exit it prints one line of counters (frames, bytes, drops
each way, CPU seconds) to stdout.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import os
import resource
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
PR_SET_PDEATHSIG = 1
MAX_FRAME = 256 * 1024  # a GSO super-frame (64 KiB and more) plus its virtio-net header
SOCKET_BUFFER = 8 * 1024 * 1024


def open_port(ifname: str) -> socket.socket:
    """A raw packet socket on `ifname` that sees only frames arriving there, with their virtio-net header."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    # FORCE variants: as root, past net.core.[rw]mem_max, so that a burst at the link's rate is not dropped.
    sock.setsockopt(socket.SOL_SOCKET, 33, SOCKET_BUFFER)  # SO_RCVBUFFORCE
    sock.setsockopt(socket.SOL_SOCKET, 32, SOCKET_BUFFER)  # SO_SNDBUFFORCE
    sock.bind((ifname, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def die_with_parent() -> None:
    """SIGKILL this process when the one that started it dies (even by SIGKILL, with no cleanup run)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before prctl took effect
        sys.exit(1)


def forward(ports: tuple[socket.socket, socket.socket], delay: float, stop: list[bool]) -> list[list[int]]:
    """The loop: move each frame arriving on ports[i] to ports[1 - i] `delay` seconds later, until stop[0].

    Returns [frames, bytes, drops] per direction (0: a -> b, 1: b -> a)."""
    queues: list[collections.deque[tuple[float, bytes]]] = [collections.deque(), collections.deque()]
    counts = [[0, 0, 0], [0, 0, 0]]
    fds = [port.fileno() for port in ports]
    while not stop[0]:
        now = time.monotonic()
        for side in (0, 1):
            queue, out = queues[side], ports[1 - side]
            while queue and queue[0][0] <= now:
                frame = queue.popleft()[1]
                try:
                    out.send(frame)
                    counts[side][0] += 1
                    counts[side][1] += len(frame)
                except OSError:  # ENOBUFS, EAGAIN: the far side is full; a wire drops the frame
                    counts[side][2] += 1
        due = [queue[0][0] for queue in queues if queue]
        timeout = max(0.0, min(due) - time.monotonic()) if due else 0.5
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            continue
        arrived = time.monotonic() + delay
        for fd in ready:
            side = fds.index(fd)
            for _ in range(64):  # drain a burst, but come back to the due frames soon
                try:
                    queues[side].append((arrived, ports[side].recv(MAX_FRAME)))
                except OSError as exc:
                    if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENETDOWN):
                        break
                    raise
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, each direction")
    parser.add_argument("ifaces", nargs=2, help="the two interfaces to join")
    args = parser.parse_args(argv)
    die_with_parent()
    stop = [False]

    def on_signal(signum: int, frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ports = (open_port(args.ifaces[0]), open_port(args.ifaces[1]))
    print("ready", flush=True)
    counts = forward(ports, args.delay_ms / 1000.0, stop)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(
        f"frames {counts[0][0]} {counts[1][0]} bytes {counts[0][1]} {counts[1][1]} "
        f"drops {counts[0][2]} {counts[1][2]} cpu_s {usage.ru_utime + usage.ru_stime:.3f}",
        flush=True,
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
