"""Benchmark: training over a slow link, synchronous against low-communication training (issue 28 item 4).

Two network-namespace hosts (testbed/netns.py, as benchmarks/hooks.py does) on a link limited by tc
to --rate (100 Mbit/s by default) and, with --delay-ms D, delayed D ms each way (a round trip of 2 D, as
netem's `delay D` on each host would give; the kernel here has no netem, so testbed/netns.py's
userspace wire adds it), each running one rank. The gpt job's model (a character-level GPT, --dim/--depth larger than
the job's default, so that its gradients are what a slow link notices) trains for the same token budget
(--steps optimizer steps of --batch sequences of --context characters per rank) in each arm:

- ddp: lockstep.DistributedDataParallel, gradients all-reduced every step;
- ddp_powersgd: the same with lockstep.hooks.powerSGD_hook (rank 4);
- torch_post_local_sgd: torch's PostLocalSGDOptimizer with a PeriodicModelAverager of period H;
- local_sgd, diloco, streaming_diloco: lockstep.replicate with SyncPolicy(sync=..., sync_every=H).

Every arm starts from the same weights and reads the same samples (rank r: its own seeded stream),
with AdamW (--lr) as the (inner) optimizer. Reported per arm: wall time to the budget (evaluation
excluded), bytes each rank handed to collectives per sample (all_reduce / all_gather payloads, counted
by lockstep.testing.watch_collectives), the final eval loss (rank 0's model on a fixed eval set), and
the eval loss against wall time, plotted to a PNG beside the table.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/low_comm.py                    # 100mbit, needs root
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/low_comm.py --delay-ms 10      # and 10 ms each way
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/low_comm.py --rate loopback --steps 60
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchmarks.common import add_worker_flags, machine_line, run_pair, run_worker  # noqa: E402
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager  # noqa: E402
from torch.distributed.optim import PostLocalSGDOptimizer  # noqa: E402

import lockstep  # noqa: E402
from lockstep import hooks  # noqa: E402
from lockstep.jobs import datasets, models  # noqa: E402
from lockstep.plan import QUANTIZED_SYNC_DTYPES  # noqa: E402
from lockstep.testing import run_distributed, watch_collectives  # noqa: E402

# --sync-dtype to SyncPolicy.delta_dtype: casts, then the quantized outer gradients (engine/core/outer_codec.py)
DTYPES: dict[str, Any] = {"fp32": None, "bf16": torch.bfloat16, **{q: q for q in QUANTIZED_SYNC_DTYPES}}
ARMS = ("ddp", "ddp_powersgd", "torch_post_local_sgd", "local_sgd", "diloco", "streaming_diloco")


# ---------------------------------------------------------------- per rank


def _model(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.TinyGPT(vocab, context=args.context, dim=args.dim, depth=args.depth, heads=4)


def _batch(data: Any, args: argparse.Namespace, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    rows = [data[int(i)] for i in torch.randint(len(data), (args.batch,), generator=g)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _eval_loss(module: torch.nn.Module, eval_batches: list[Any]) -> float:
    module.eval()
    with torch.no_grad():
        total = sum(float(_loss(module(x), y)) for x, y in eval_batches) / len(eval_batches)
    module.train()
    return total


class _Arm:
    """One arm's model, optimizer and the call after each optimizer step."""

    def __init__(self, name: str, args: argparse.Namespace, vocab: int, warm: dict[str, Any]) -> None:
        self.module = _model(args, vocab)
        self.module.load_state_dict(warm["model"])
        self.model: Any = self.module
        self.after_step = lambda: None
        self.finish = lambda: None  # at the end of the budget: streaming applies its fragment in flight
        opt = torch.optim.AdamW(self.module.parameters(), lr=args.lr)
        opt.load_state_dict(warm["optimizer"])
        if name in ("ddp", "ddp_powersgd"):
            self.model = lockstep.DistributedDataParallel(self.module)
            if name == "ddp_powersgd":
                state = hooks.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
                self.model.register_comm_hook(state, hooks.powerSGD_hook)
        elif name == "torch_post_local_sgd":
            opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=args.sync_every, warmup_steps=0))
        else:
            policy = lockstep.SyncPolicy(
                sync=name,
                sync_every=args.sync_every,
                outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum,
                fragments=args.fragments if name == "streaming_diloco" else 1,
                delta_dtype=None if name == "local_sgd" else DTYPES[args.sync_dtype],
                outer_momentum_warmup=args.outer_momentum_warmup,
                mix=args.fragment_mix,
                fragment_layout=args.fragment_layout,
                fragment_delay=args.fragment_delay if name == "streaming_diloco" else 1,
            )
            handle = lockstep.replicate(self.module, policy=policy)
            self.after_step = handle.after_optimizer_step
            self.finish = handle.flush_sync
        self.opt = opt


def _warm_start(args: argparse.Namespace, train: Any, vocab: int, rank: int) -> dict[str, Any]:
    """--warmup synchronous steps (DDP), off the clock: every arm starts from their model and AdamW state,
    as DiLoCo starts from a model already past its first, chaotic steps."""
    module = _model(args, vocab)
    model = lockstep.DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    for step in range(args.warmup):
        x, y = _batch(train, args, rank, 10_000_000 + step)
        opt.zero_grad(set_to_none=True)
        _loss(model(x), y).backward()
        opt.step()
    return {"model": module.state_dict(), "optimizer": opt.state_dict()}


def bench_worker(args: argparse.Namespace) -> dict[str, Any]:
    rank = dist.get_rank()
    train, test, vocab = datasets.stdlib_text(args.context)
    warm = _warm_start(args, train, vocab, rank)
    eval_batches = [_batch(test, args, 10_000 + i, 0) for i in range(args.eval_batches)]
    marks = set(range(0, args.steps + 1, max(1, args.steps // args.points))) | {args.steps}
    out: dict[str, Any] = {"arms": {}, "params": sum(p.numel() for p in _model(args, vocab).parameters())}
    for name in args.arms:
        arm = _Arm(name, args, vocab, warm)
        counted, peak = [0], [0]
        curve: list[tuple[float, float]] = []
        wall = 0.0

        def count(t: torch.Tensor, counted: list[int] = counted, peak: list[int] = peak) -> None:
            if t.is_floating_point() or t.dtype == torch.uint8:  # uint8: a quantized outer gradient's payload
                counted[0] += t.numel() * t.element_size()
                peak[0] = max(peak[0], t.numel() * t.element_size())  # the largest single collective

        dist.barrier()
        for step in range(args.steps + 1):
            if step == args.steps:
                arm.finish()
            if step in marks:  # evaluation is off the clock: rank 0 evaluates, the other waits
                loss = _eval_loss(arm.module, eval_batches) if rank == 0 else 0.0
                curve.append((wall, loss))
                dist.barrier()
            if step == args.steps:
                break
            start = time.perf_counter()
            with watch_collectives(count):
                x, y = _batch(train, args, rank, step)
                arm.opt.zero_grad(set_to_none=True)
                _loss(arm.model(x), y).backward()
                arm.opt.step()
                arm.after_step()
            wall += time.perf_counter() - start
        walls = torch.tensor([wall], dtype=torch.float64)
        dist.all_reduce(walls, op=dist.ReduceOp.MAX)  # the arm ends when its slowest rank does
        samples = args.steps * args.batch * dist.get_world_size()
        out["arms"][name] = {
            "wall_s": float(walls),
            "bytes": counted[0],
            "bytes_per_sample": counted[0] / samples,
            "peak_collective_bytes": peak[0],
            "final_eval_loss": curve[-1][1],
            "curve": curve,
        }
        print(
            f"[rank {rank}] {name}: {out['arms'][name]['wall_s']:.1f} s, loss {curve[-1][1]:.4f}", flush=True
        )
    return out


# ---------------------------------------------------------------- the launch and the report


def report(res: dict[str, Any], args: argparse.Namespace, plot: Path) -> str:
    arms = res["arms"]
    ddp = arms.get("ddp")
    link = "tc tbf on each host's egress; no added delay"
    if args.delay_ms:
        link = (
            f"tc tbf on each host's egress, then {args.delay_ms:g} ms one way in each direction (round trip "
            f"{2 * args.delay_ms:g} ms) from testbed/netns.py's delaying wire, a userspace AF_PACKET "
            f"forwarder in a middle namespace (the kernel has no netem); the wire used "
            f"{res['wire_cpu_s']:.1f} CPU s over the whole run"
        )
    tokens = args.steps * args.batch * 2 * args.context
    lines = [
        f"# Training over a slow link: synchronous against low-communication training ({datetime.date.today()})",
        "",
        f"Machine: {machine_line()}. Two network-namespace hosts, one rank each, link {args.rate} ({link}). "
        "Model: TinyGPT "
        f"dim {args.dim}, depth {args.depth}, context {args.context} ({res['params']:,} parameters). Token "
        f"budget: {args.steps} steps x {args.batch} sequences x 2 ranks = {tokens:,} tokens. AdamW lr {args.lr}; "
        f"H = {args.sync_every}, outer lr {args.outer_lr}, outer momentum {args.outer_momentum} (Nesterov, "
        f"rising from 0 over the first {args.outer_momentum_warmup} outer steps), {args.fragments} fragments "
        f"for streaming ({args.fragment_layout}, mix {args.fragment_mix}, delay {args.fragment_delay}); "
        f"DiLoCo's deltas sent in {args.sync_dtype}. Every arm starts "
        f"from the same {args.warmup} synchronous (DDP) steps, untimed and uncounted. Wall time excludes "
        "evaluation.",
        "",
        "| arm | wall s | bytes / sample | final eval loss | wall vs ddp | bytes vs ddp | loss vs ddp |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in arms.items():
        vs = (
            (
                f"{row['wall_s'] / ddp['wall_s']:.3f}",
                f"1/{ddp['bytes_per_sample'] / row['bytes_per_sample']:.0f}"
                if row["bytes_per_sample"]
                else "-",
                f"{100 * (row['final_eval_loss'] / ddp['final_eval_loss'] - 1):+.2f}%",
            )
            if ddp
            else ("-", "-", "-")
        )
        lines.append(
            f"| {name} | {row['wall_s']:.1f} | {row['bytes_per_sample']:,.0f} | {row['final_eval_loss']:.4f} | "
            f"{vs[0]} | {vs[1]} | {vs[2]} |"
        )
    lines += ["", f"![eval loss against wall time]({plot.name})", ""]
    return "\n".join(lines)


def draw(res: dict[str, Any], path: Path, link: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in res["arms"].items():
        walls, losses = zip(*row["curve"])
        ax.plot(walls, losses, marker="o", markersize=3, label=name)
    ax.set_xlabel("wall time (s), evaluation excluded")
    ax.set_ylabel("eval loss")
    ax.set_title(f"TinyGPT, 2 ranks over {link}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate between the hosts, or 'loopback'")
    parser.add_argument(
        "--delay-ms", type=float, default=0.0, help="one-way delay each direction (round trip: twice this)"
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sync-every", type=int, default=25)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--fragments", type=int, default=4)
    defaults = lockstep.SyncPolicy()
    parser.add_argument("--outer-momentum-warmup", type=int, default=defaults.outer_momentum_warmup)
    parser.add_argument("--fragment-mix", type=float, default=defaults.mix, help="streaming's alpha")
    parser.add_argument("--fragment-layout", default=defaults.fragment_layout, help="streaming's fragments")
    parser.add_argument(
        "--fragment-delay", type=int, default=defaults.fragment_delay, help="streaming's tau (inner steps)"
    )
    parser.add_argument(
        "--sync-dtype", default="fp32", choices=list(DTYPES), help="diloco's deltas on the wire"
    )
    parser.add_argument("--warmup", type=int, default=50, help="synchronous steps before every arm, untimed")
    parser.add_argument("--points", type=int, default=10, help="evaluations along the run")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--out", default="", help="report path (default benchmarks/results/<date>-low_comm.md)"
    )
    add_worker_flags(parser)
    args = parser.parse_args()
    if run_worker(args, bench_worker):
        return
    if args.rate == "loopback" and args.delay_ms:
        parser.error("--delay-ms needs the namespace hosts: give a --rate, not loopback")
    if args.rate == "loopback":
        res = run_distributed(bench_worker, 2, args=(args,), timeout=args.timeout)[0]
    else:
        forward = [a for a in sys.argv[1:]]
        with tempfile.TemporaryDirectory() as tmp:
            out_json = Path(tmp) / "low_comm.json"
            res = run_pair(
                __file__,
                args.rate,
                forward,
                out_json,
                port=29533,
                timeout=args.timeout,
                delay_ms=args.delay_ms,
            )
    out = (
        Path(args.out)
        if args.out
        else ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-low_comm.md"
    )
    plot = out.with_suffix(".png")
    draw(res, plot, f"{args.rate}, {args.delay_ms:g} ms each way" if args.delay_ms else args.rate)
    text = report(res, args, plot)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    print(text)
    print(f"written to {out} and {plot}")


if __name__ == "__main__":
    main()
