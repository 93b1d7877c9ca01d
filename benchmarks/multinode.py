"""Benchmark: 2 nodes across two network namespaces with the link limited by tc (issue 7).

For each link rate (unshaped, 10 Gbit/s, 1 Gbit/s, 100 Mbit/s) two "hosts" are built with
testbed/netns.py (a bridge, one veth each, a tbf on each veth's egress) and one process starts on each,
joined by lockstep.init() over the veth (GLOO_SOCKET_IFNAME). Each pair measures

- the all-reduce bandwidth gloo reaches (bytes each rank sends per second; for 2 ranks an all-reduce of
  S bytes sends S bytes each way) against the link's limit;
- the training step time of torch's DistributedDataParallel and lockstep.DistributedDataParallel, torch's
  and lockstep's fp16_compress_hook, and lockstep's PowerSGD (rank 4; torch's aborts or hangs on gloo with
  more than one bucket, see benchmarks/hooks.py), for the benchmark models: an MLP with 3.2M parameters
  (12.6 MB of fp32 gradients) and engine_vs_ddp.py's ResNet, GPT and many-small-layers models: identical
  weights and data, a gradient parity check first, rounds in alternating order (A-B-..., then ...-B-A),
  each engine a warm-up step then timed steps, a step's time is the slowest rank's; the median of
  per-round ratios to torch DDP with [min-max]. "torch (again)" is torch against itself: the noise floor.

Needs root (network namespaces). Both "hosts" share this machine's cores: compute is not parallel as on two
real machines, so step times are comparable as ratios only.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/multinode.py            # about 15 minutes on 2 cores
    .venv/bin/python benchmarks/multinode.py --rates 1gbit --models mlp --rounds 2      # quicker
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

from testbed.netns import rate_bits  # noqa: E402

ENGINES = ("torch", "lockstep", "torch (again)", "torch+fp16", "lockstep+fp16", "lockstep+powerSGD r4")
MODELS = ("mlp", "resnet", "gpt", "many_small")  # mlp: common.link_mlp; the others: engine_vs_ddp.py's


# ---------------------------------------------------------------- worker (one per "host")


def _model(name: str) -> Any:
    return common.link_mlp() if name == "mlp" else common.build(name)


def _data(name: str, rank: int, step: int) -> tuple[Any, Any]:
    return common.link_batch(rank, step) if name == "mlp" else common.batch(name, rank, step)


def _loss(name: str, out: Any, y: Any) -> Any:
    return common.loss(name, out, y)  # cross-entropy for mlp, as for the other classifiers


def _comm_hook(kind: str) -> tuple[Any, Any] | None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from lockstep import hooks

    if kind == "torch+fp16":
        return None, fp16_compress_hook
    if kind == "lockstep+fp16":
        return hooks.HookState(None), hooks.fp16_compress_hook
    if kind == "lockstep+powerSGD r4":  # compressed from the first timed step (step 0 is the warm-up)
        return hooks.PowerSGDState(
            None, matrix_approximation_rank=4, start_powerSGD_iter=1
        ), hooks.powerSGD_hook
    return None


def _wrap(kind: str, name: str, state: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import lockstep

    model = _model(name)
    model.load_state_dict(state)
    wrapped = lockstep.DistributedDataParallel(model) if kind.startswith("lockstep") else TorchDDP(model)
    hook = _comm_hook(kind)
    if hook is not None:
        wrapped.register_comm_hook(*hook)
    return wrapped, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(engine: tuple[Any, Any], name: str, rank: int, step: int) -> None:
    model, opt = engine
    x, y = _data(name, rank, step)
    opt.zero_grad(set_to_none=True)
    _loss(name, model(x), y).backward()
    opt.step()


def _parity(name: str, state: dict[str, Any], rank: int) -> float:
    """Max |grad difference| between torch DDP and lockstep after one step from the same weights and data."""
    grads = []
    for kind in ("torch", "lockstep"):
        model, _ = _wrap(kind, name, state)
        x, y = _data(name, rank, 0)
        _loss(name, model(x), y).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*grads))


def _allreduce_bandwidth(sizes_mb: list[float], reps: int) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    rows = []
    for size_mb in sizes_mb:
        tensor = torch.ones(int(size_mb * 2**20 / 4))
        dist.all_reduce(tensor)  # warm-up: connections and buffers
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(float(took.item()))
        best = min(times)
        # 2 ranks: each sends half the buffer in the reduce-scatter and half in the all-gather.
        rows.append({"size_mb": size_mb, "seconds": best, "gbit_per_s": tensor.numel() * 4 * 8 / best / 1e9})
    return rows


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import lockstep

    topo = lockstep.init(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=120)
    rank = topo.rank
    result: dict[str, Any] = {"allreduce": _allreduce_bandwidth(args.sizes_mb, args.reps), "models": {}}
    for name in args.models:
        model = _model(name)
        state = model.state_dict()
        times: dict[str, list[float]] = {kind: [] for kind in ENGINES}
        for round_index in range(args.rounds):
            for kind in common.round_order(ENGINES, round_index):
                engine = _wrap(kind, name, state)
                step = functools.partial(_step, engine, name, rank)
                times[kind].append(common.slowest_rank_seconds(step, args.warmup, args.steps))
                del engine
        result["models"][name] = {
            "parity": _parity(name, state, rank),
            "times": times,
            "grad_mb": sum(p.numel() * 4 for p in model.parameters()) / 1e6,
        }
    dist.barrier()
    if rank == 0:
        Path(args.out_json).write_text(json.dumps(result))
    lockstep.shutdown()


# ---------------------------------------------------------------- driver (root namespace)


def run_rate(rate: str | None, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rounds = args.slow_rounds if rate == "100mbit" else args.rounds
    forward = [
        "--models",
        *args.models,
        "--rounds",
        str(rounds),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--reps",
        str(args.reps),
        "--sizes-mb",
        *[str(s) for s in args.sizes_mb],
    ]
    out_json = workdir / f"result-{rate or 'unshaped'}.json"
    return common.run_pair(__file__, rate, forward, out_json, port=29500, timeout=args.timeout)


def _ratio_text(times: dict[str, list[float]], kind: str) -> str:
    return common.fmt_ratios([a / b for a, b in zip(times[kind], times["torch"])])


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        f"# Multi-node benchmark: 2 namespace hosts, tc tbf link limit ({datetime.date.today().isoformat()})",
        "",
        f"Machine: {common.machine_line()}; both hosts on the same cores. Models: mlp = MLP "
        f"1024-1024-1024-1024-10 (batch {common.LINK_BATCH} per rank); resnet, gpt, many_small as in engine_vs_ddp.py; SGD. {args.rounds} rounds in "
        f"alternating order ({args.slow_rounds} at 100mbit), "
        f"{args.warmup} warm-up + {args.steps} timed steps per engine per round; step time = slowest rank; "
        f"ratios = median [min-max] of per-round ratios to torch DDP. Run took {seconds:.0f} s.",
        "`python benchmarks/multinode.py` (as root).",
        "",
        "## All-reduce bandwidth vs the link (best of "
        f"{args.reps}; for 2 ranks an all-reduce of S bytes sends S bytes each way)",
        "",
        "| link | " + " | ".join(f"{s:g} MB: Gbit/s (% of link)" for s in args.sizes_mb) + " |",
        "|---|" + "---|" * len(args.sizes_mb),
    ]
    for rate, res in results.items():
        limit = rate_bits(rate) / 1e9 if rate != "unshaped" else None
        cells = [
            f"{row['gbit_per_s']:.3f}" + (f" ({100 * row['gbit_per_s'] / limit:.0f}%)" if limit else "")
            for row in res["allreduce"]
        ]
        lines.append(f"| {rate} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Step time (ms, median over rounds) and ratio to torch DDP",
        "",
        "| link | model (fp32 grads) | grad parity (max abs diff) | "
        + " | ".join(ENGINES)
        + " | "
        + " | ".join(f"{k} / torch" for k in ENGINES[1:])
        + " |",
        "|---|---|---|" + "---|" * (2 * len(ENGINES) - 1),
    ]
    for rate, res in results.items():
        for name, model in res["models"].items():
            times = model["times"]
            ms = [f"{1000 * statistics.median(times[k]):.0f}" for k in ENGINES]
            ratios = [_ratio_text(times, k) for k in ENGINES[1:]]
            lines.append(
                f"| {rate} | {name} ({model['grad_mb']:.1f} MB) | {model['parity']:.1e} | "
                + " | ".join(ms)
                + " | "
                + " | ".join(ratios)
                + " |"
            )
    lines += [
        "",
        "Notes:",
        "- torch (again) / torch is the noise floor of this run.",
        "- torch+fp16: torch's `fp16_compress_hook`; lockstep+fp16: lockstep.hooks' (the same contract); "
        "lockstep+powerSGD r4: lockstep.hooks.powerSGD_hook, rank 4, compressing from the first timed step. "
        "torch's PowerSGD is not in the table: on gloo it aborts or hangs once a model has several buckets.",
        "- The two hosts share 2 cores, so compute does not overlap across hosts as it would on two "
        "machines; on a slow link the all-reduce dominates and the ratios show what the engine adds.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_worker_flags(parser)
    parser.add_argument("--rates", nargs="+", default=["unshaped", "10gbit", "1gbit", "100mbit"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--slow-rounds", type=int, default=2, help="rounds at 100mbit")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 16.0])
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--out", default=None, help="report path (default benchmarks/results/multinode-DATE.md)"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if os.geteuid() != 0:
        sys.exit("benchmarks/multinode.py needs root (it creates network namespaces)")
    started = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            t0 = time.time()
            results[rate] = run_rate(None if rate == "unshaped" else rate, args, Path(tmp))
            print(f"{rate}: done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    text = report(results, args, time.time() - started)
    out = (
        Path(args.out)
        if args.out
        else ROOT / "benchmarks" / "results" / f"multinode-{datetime.date.today().isoformat()}.md"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
