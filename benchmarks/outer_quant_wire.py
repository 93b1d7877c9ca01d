"""Benchmark: the bytes one outer sync puts on the wire, per sync_dtype and world size (issue 35 item 3).

DiLoCo's outer sync of one parameter tensor of --numel values (the low_comm benchmark's TinyGPT has
3,200,512), on W ranks of gloo over TCP on the loopback interface of a network namespace of its own
(run it under `unshare -n`, as root: then nothing else uses that interface). The interface's byte counters
(/proc/net/dev, TCP/IP headers included) are read around the sync; a barrier-only interval measured the
same way is subtracted. Reported per rank (the total over the ranks / W) beside the bytes rank 0 counts in
comm_bytes (its payload, or what its inputs send the others) and the formula:

- fp32 (not deterministic): a ring all-reduce, 2 (W - 1) / W * 4n per rank;
- bf16, and the quantized formats at W = 2: an all-gather of the payload p, (W - 1) * p per rank (bf16:
  2n; int8: 4 ceil(n/128) + n; int4 and fp4_e3m0: 4 ceil(n/128) + ceil(n/2));
- the quantized formats at W >= 3 (engine/periodic/outer_reduce.py): a reduce-scatter of the W chunks' payloads
  p_j (each rank sends the W - 1 others': (W - 1) / W * sum p_j per rank on average), then a ring
  all-gather of the mean chunks padded to max p_j ((W - 1) * max p_j): about 2 (W - 1) / W * p.
  `--schemes gather` forces the gather there instead (the scheme before it), `--schemes scatter` the
  reduce-scatter at W = 2 too, for comparison.

    unshare -n sh -c 'ip link set lo up && OMP_NUM_THREADS=1 .venv/bin/python benchmarks/outer_quant_wire.py'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lockstep  # noqa: E402
from lockstep.engine.core.outer_codec import codec_for  # noqa: E402
from lockstep.engine.periodic import outer_reduce  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

FORMATS: dict[str, Any] = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8", "int4": "int4"}
FORMATS["fp4_e3m0"] = "fp4_e3m0"


def _lo_bytes() -> int:
    """Bytes sent on this namespace's loopback interface so far (per namespace: /proc/self/net/dev)."""
    for line in Path("/proc/self/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmit bytes
    raise SystemExit("no loopback interface in /proc/self/net/dev")


def _interval(action: Any) -> int:
    dist.barrier()
    before = _lo_bytes()
    dist.barrier()
    action()
    dist.barrier()
    after = _lo_bytes()
    dist.barrier()
    return after - before


def worker(numel: int, wire: str, scheme: str) -> dict[str, int]:
    if scheme == "gather":  # the quantized gather at any W (what every W used before outer_reduce.py)
        outer_reduce.SCATTER_FROM_WORLD = sys.maxsize
    elif scheme == "scatter":  # the reduce-scatter at W = 2 too
        outer_reduce.SCATTER_FROM_WORLD = 2
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(numel))
    handle = lockstep.replicate(
        model, policy=lockstep.SyncPolicy(sync="diloco", sync_every=1, delta_dtype=FORMATS[wire])
    )
    with torch.no_grad():
        model.weight.add_(torch.randn(numel) * 1e-3)  # an outer gradient to send
    quiet = min(_interval(lambda: None) for _ in range(3))  # the barriers' own traffic
    synced = _interval(handle.after_optimizer_step)
    return {"wire": synced - quiet, "payload": int(handle.stats().extras["bytes_communicated_total"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=3_200_512)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--formats", nargs="+", default=["fp32", "int8", "int4"], choices=list(FORMATS))
    parser.add_argument(
        "--schemes",
        nargs="+",
        default=["auto"],
        choices=["auto", "gather", "scatter"],
        help="quantized formats: gather (never scatter) or scatter (from W = 2) besides the default",
    )
    args = parser.parse_args()
    n = args.numel
    print(
        "| W | sync_dtype | scheme | payload / rank (comm_bytes) | on the wire / rank | formula / rank | "
        "wire vs fp32 |"
    )
    print("|---|---|---|---|---|---|---|")
    for world in args.worlds:
        fp32_wire = 0.0
        for wire in args.formats:
            codec = codec_for(FORMATS[wire])
            default = "scatter" if outer_reduce.scatters(codec, world) else "gather"
            for scheme in args.schemes if codec.quantized else ["auto"]:
                used = default if scheme == "auto" else scheme
                if scheme != "auto" and used == default:
                    continue  # the default's run
                outs = run_distributed(worker, world, args=(n, wire, scheme), timeout=300)
                per_rank = outs[0]["wire"] / world
                if wire == "fp32":
                    used = "all-reduce"
                fp32_wire = fp32_wire or per_rank
                print(
                    f"| {world} | {wire} | {used} | {outs[0]['payload']:,} | {per_rank:,.0f} | "
                    f"{_formula(codec, n, world, used):,.0f} | {fp32_wire / per_rank:.2f}x fewer |",
                    flush=True,
                )


def _formula(codec: Any, n: int, world: int, scheme: str) -> float:
    """The bytes on the wire per rank (the module doc), TCP/IP headers left out."""
    if scheme == "all-reduce":
        return 2 * (world - 1) / world * 4 * n
    if scheme == "gather":
        return (world - 1) * codec.payload_bytes(n)
    chunks = [codec.payload_bytes(stop - start) for start, stop in outer_reduce.chunk_bounds(n, world)]
    return (world - 1) / world * sum(chunks) + (world - 1) * max(chunks)


if __name__ == "__main__":
    main()
