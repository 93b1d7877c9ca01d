"""Benchmark: the delaying wire of testbed/netns.py (round trip, throughput, its own CPU cost).

The kernel here has no netem, so netns_hosts(2, rate=R, delay_ms=D) adds the delay with a userspace
AF_PACKET forwarder in a middle namespace (testbed/wire.py). This script checks it on the link
low_comm.py uses, once with the plain bridge (no delay) and once with each --delay-ms, at --rate:

- ping: ICMP round trips from host 0 to host 1 (after one for ARP), median and min-max;
- tcp: one TCP transfer of --tcp-mb MB from host 0 to host 1, in Mbit/s (slow start included);
- all_reduce: gloo all-reduces of --numel fp32 values (12.8 MB: TinyGPT dim 256's gradients, what DDP
  sends each step in low_comm.py), the median over --reps after one warm-up, in s and in Mbit/s of the
  bytes each rank sends (a ring of 2: the tensor's size);
- wire CPU: the forwarder's user + system CPU seconds over each phase, per second of that phase.

    .venv/bin/python benchmarks/link_delay.py --rate 100mbit --delay-ms 10     # needs root
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchmarks.common import add_worker_flags, machine_line, run_pair, run_worker, write_report  # noqa: E402

from testbed.netns import netns_hosts, ping_ms, wire_cpu_seconds  # noqa: E402

SINK = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    n += len(d)
print(n, flush=True)
"""
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = bytes(1 << 20)
start = time.monotonic()
for _ in range(int(sys.argv[3])):
    c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print(time.monotonic() - start)
"""


def allreduce_worker(args: argparse.Namespace) -> dict[str, Any]:
    t = torch.ones(args.numel)
    dist.all_reduce(t)
    times = []
    for _ in range(args.reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return {"allreduce_s": times}


def link_phase(rate: str, delay_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    """ping and tcp on one pair of hosts (the all-reduce runs on a fresh pair, through run_pair)."""
    with netns_hosts(2, rate=rate, delay_ms=delay_ms) as (a, b):
        ping_ms(a, b.addr, 1)
        cpu = wire_cpu_seconds([a, b])
        start = time.monotonic()
        rtts = ping_ms(a, b.addr, args.pings)
        ping_cpu = (wire_cpu_seconds([a, b]) - cpu) / (time.monotonic() - start)
        sink = b.popen([sys.executable, "-c", SINK, b.addr], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        port = sink.stdout.readline().strip() if sink.stdout else ""
        cpu = wire_cpu_seconds([a, b])
        start = time.monotonic()
        sent = a.run([sys.executable, "-c", SOURCE, b.addr, port, str(args.tcp_mb)], timeout=300)
        tcp_cpu = (wire_cpu_seconds([a, b]) - cpu) / (time.monotonic() - start)
        got, _ = sink.communicate(timeout=60)
    seconds = float(sent.stdout)
    return {
        "rtt_ms": rtts,
        "ping_wire_cpu": ping_cpu,
        "tcp_mbit_s": int(got) * 8 / seconds / 1e6,
        "tcp_wire_cpu": tcp_cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[10.0])
    parser.add_argument("--pings", type=int, default=20)
    parser.add_argument("--tcp-mb", type=int, default=40)
    parser.add_argument("--numel", type=int, default=3_200_512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="")
    add_worker_flags(parser)
    args = parser.parse_args()
    if run_worker(args, allreduce_worker):
        return
    rows = []
    for delay in [0.0, *args.delay_ms]:
        row = link_phase(args.rate, delay, args)
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            forward = [f"--numel={args.numel}", f"--reps={args.reps}"]
            res = run_pair(
                __file__, args.rate, forward, Path(tmp) / "r.json", port=29541, timeout=600, delay_ms=delay
            )
            span = time.monotonic() - start
        median = statistics.median(res["allreduce_s"])
        row.update(
            delay_ms=delay,
            allreduce_s=median,
            allreduce_mbit_s=args.numel * 4 * 8 / median / 1e6,
            allreduce_wire_cpu_s=res["wire_cpu_s"],
            allreduce_span_s=span,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = [
        f"# The delaying wire: round trip, throughput, CPU cost ({datetime.date.today()})",
        "",
        f"Machine: {machine_line()}. Two network-namespace hosts at {args.rate} (tc tbf on each host's egress); "
        "delay 0: the hosts' veths on a bridge; delay D: the veths' peers in a middle namespace joined by "
        "testbed/wire.py (AF_PACKET, PACKET_VNET_HDR so offloads pass through), D ms each way. "
        f"ping: {args.pings} ICMP echoes; tcp: {args.tcp_mb} MB one way; all-reduce: {args.numel:,} fp32 "
        f"({args.numel * 4 / 1e6:.1f} MB), median of {args.reps}. Wire CPU: the forwarder's CPU seconds per "
        "second of the phase (1.0 = one core); for the all-reduce, its total over the run (2-rank gloo start-up included).",
        "",
        "| delay each way | ping RTT ms, median [min-max] | tcp Mbit/s | wire CPU, tcp | all-reduce s | all-reduce Mbit/s | wire CPU s, all-reduce run |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rtt = r["rtt_ms"]
        lines.append(
            f"| {r['delay_ms']:g} ms | {statistics.median(rtt):.2f} [{min(rtt):.2f}-{max(rtt):.2f}] | "
            f"{r['tcp_mbit_s']:.1f} | {r['tcp_wire_cpu']:.3f} | {r['allreduce_s']:.3f} | "
            f"{r['allreduce_mbit_s']:.1f} | {r['allreduce_wire_cpu_s']:.2f} of {r['allreduce_span_s']:.1f} s |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = write_report(text, "link_delay", args.out)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
