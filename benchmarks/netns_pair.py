"""Run one benchmark worker on each of two network-namespace hosts (tests/testbed/netns.py) and read its result.

Shared by benchmarks/multinode.py and benchmarks/hooks.py: rank r runs `python SCRIPT --worker --out-json F
ARGS` on host r with the env lockstep.init() reads (RANK, WORLD_SIZE, MASTER_ADDR on host 0) and gloo bound to
the host's veth; rank 0 writes the JSON result to F. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """The hidden flags with which run_pair starts SCRIPT on each host."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-json", default="", help=argparse.SUPPRESS)


def run_pair(script: str, rate: str | None, argv: Sequence[str], out_json: Path, *, port: int,
             timeout: float) -> dict[str, Any]:
    """Both workers to completion on a link limited to `rate` (None: unshaped); rank 0's JSON result."""
    sys.path.insert(0, str(ROOT))
    from tests.testbed.netns import netns_hosts

    with netns_hosts(2, rate=rate) as hosts:
        procs = []
        for rank, host in enumerate(hosts):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": hosts[0].addr,
                   "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": host.ifname, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT)}
            procs.append(host.popen([sys.executable, script, "--worker", "--out-json", str(out_json), *argv],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    if any(proc.returncode for proc in procs) or not out_json.exists():
        raise RuntimeError(f"link {rate or 'unshaped'}: workers failed: {[o[1][-2000:] for o in outputs]}")
    return dict(json.loads(out_json.read_text()))
