"""Benchmark: lockstep's sharded engine (FSDP, HSDP on torch's FSDP2) against torch's own fully_shard, with the
replicated layouts for the memory baseline, gloo on CPU.

The model is the gpt job's TinyGPT (`--dim 256 --depth 8`, the job's context 64 and heads 4, the vocab of its
stdlib text), trained with AdamW on a few random sequences per rank. Layouts:
- `ddp`: lockstep's replicated engine (`lockstep.replicate(module)`, lockstep's own bucketed all-reduce, not
  torch's DDP) with the unsharded AdamW;
- `zero1`: the same with `handle.shard_optimizer(AdamW(...))` (ZeRO-1);
- `fsdp`: `lockstep.engine.sharded.shard(module, ShardPolicy(shard_degree=W))` (each block an FSDP2 unit, then
  the root; the tracked all-gather / reduce-scatter installed);
- `hsdp` (W = 4): the same with shard_degree 2 (a (2, 2) replicate x shard mesh);
- `torch_fsdp2`: torch's `fully_shard` on each block then the root, on a 1-D mesh of W, used directly (the peer);
- `torch_hsdp2` (W = 4): torch's `fully_shard` on a 2-D (2, 2) mesh.

Protocol (DESIGN.md), two parts:
- Step-time ratios, one launch per world size: lockstep's fsdp (and hsdp) against torch's fully_shard at the
  same layout, both built from the same weights and fed the same data, a parity check of the full parameters
  after one step before timing, rounds in A-B-B-A order (warm-up steps, then timed steps), a step's time the
  slowest rank's; the median of the per-round ratios lockstep/torch with its min-max, and the same protocol
  with torch's fully_shard on both sides (fsdp layout) as the noise floor.
- Memory and each layout's own step time, one launch per layout and world size (peak RSS only grows): the
  model state on rank 0 (`lockstep.runtime.memory.model_state_bytes`: parameters + gradients + optimizer
  state, local shards only, exact) after a step and before zero_grad, its ratio to ddp's, the peak RSS of
  every rank, and the mean step time over a few steps (slowest rank).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/sharding.py --world-sizes 2 4 --rounds 4 --steps 4 \\
        --out benchmarks/results/2026-11-29-sharding.md
"""

from __future__ import annotations

import argparse
import datetime
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchmarks.common import fmt_ratios, machine_line, paired_rounds, write_report  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import lockstep  # noqa: E402
from lockstep.engine.sharded import ShardPolicy, full_tensors, shard  # noqa: E402
from lockstep.jobs.models import TinyGPT  # noqa: E402
from lockstep.runtime.memory import model_state_bytes  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

LR = 1e-4
CONTEXT, HEADS = 64, 4  # the gpt job's defaults (jobs/configs.py GptConfig)
LAYOUTS = ["ddp", "zero1", "fsdp", "hsdp", "torch_fsdp2", "torch_hsdp2"]
SHARDED = {"fsdp", "hsdp", "torch_fsdp2", "torch_hsdp2"}


def _vocab() -> int:
    from lockstep.jobs import datasets

    return datasets.stdlib_text(CONTEXT)[2]


# ---------------------------------------------------------------- per rank


class _Layout:
    """One layout's model, optimizer and step (`step(i)`: zero_grad, forward, backward, optimizer step)."""

    def __init__(self, kind: str, cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        self.kind, self.cfg = kind, cfg
        world = dist.get_world_size()
        self.module = TinyGPT(cfg["vocab"], context=CONTEXT, dim=cfg["dim"], depth=cfg["depth"], heads=HEADS)
        self.module.load_state_dict(state)
        if kind in ("ddp", "zero1"):
            self.handle: Any = lockstep.replicate(self.module)
            self.inner = torch.optim.AdamW(self.module.parameters(), lr=LR)
            self.opt: Any = self.handle.shard_optimizer(self.inner) if kind == "zero1" else self.inner
            return
        if kind in ("fsdp", "hsdp"):
            degree = world if kind == "fsdp" else 2
            self.handle = shard(self.module, ShardPolicy(shard_degree=degree))
        else:
            mesh = (
                init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
                if kind == "torch_fsdp2"
                else init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
            )
            for block in self.module.blocks.children():
                fully_shard(block, mesh=mesh)
            fully_shard(self.module, mesh=mesh)
        self.opt = self.inner = torch.optim.AdamW(self.module.parameters(), lr=LR)

    def step(self, step: int) -> None:
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        tokens = torch.randint(0, self.cfg["vocab"], (self.cfg["batch"], CONTEXT + 1), generator=gen)
        self.opt.zero_grad(set_to_none=True)
        logits = self.module(tokens[:, :-1])
        nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        ).backward()
        self.opt.step()

    def full_params(self) -> dict[str, torch.Tensor]:
        return full_tensors({n: p.detach() for n, p in self.module.named_parameters()})


def _initial_state(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return TinyGPT(
        cfg["vocab"], context=CONTEXT, dim=cfg["dim"], depth=cfg["depth"], heads=HEADS
    ).state_dict()


def _parity(a: _Layout, b: _Layout) -> float:
    """Max relative difference of the full parameters after one step from the same weights and data."""
    a.step(0)
    b.step(0)
    worst = 0.0
    pa, pb = a.full_params(), b.full_params()
    for name in pb:
        scale = float(pb[name].abs().max()) or 1.0
        worst = max(worst, float((pa[name] - pb[name]).abs().max()) / scale)
    if worst > 1e-5:
        raise RuntimeError(f"parameter parity check failed: max relative difference {worst:.3g}")
    return worst


def ratio_worker(cfg: dict[str, Any], pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """The interleaved pairs (lockstep/torch at each layout, torch/torch as the floor) in one launch."""
    state = _initial_state(cfg)
    result: dict[str, Any] = {}
    for kind_a, kind_b in pairs:
        a, b = _Layout(kind_a, cfg, state), _Layout(kind_b, cfg, state)
        name = f"{kind_a}/{kind_b}"
        result[f"parity {name}"] = _parity(a, b)
        result[name] = paired_rounds(a, b, cfg["rounds"], cfg["warmup"], cfg["steps"])
        if dist.get_rank() == 0:
            print(f"  W={dist.get_world_size()} {name}: {fmt_ratios(result[name]['ratios'])}", flush=True)
        del a, b
    return result


def memory_worker(cfg: dict[str, Any], kind: str, steps: int) -> dict[str, Any]:
    """One layout alone in its processes: model state after a step, peak RSS, mean step time."""
    layout = _Layout(kind, cfg, _initial_state(cfg))
    layout.step(0)  # warm-up
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        layout.step(i)
    elapsed = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    counted = model_state_bytes(layout.module, layout.opt)  # after a step, before zero_grad
    return {
        "state": counted.total,
        "params": counted.params,
        "grads": counted.grads,
        "optimizer": counted.optimizer,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "step_s": float(elapsed.item()),
    }


# ---------------------------------------------------------------- driver


def _layouts(world: int) -> list[str]:
    return [k for k in LAYOUTS if world >= 4 or k not in ("hsdp", "torch_hsdp2")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--steps", type=int, default=4, help="timed steps per engine per round (half each time)"
    )
    parser.add_argument("--memory-steps", type=int, default=3, help="timed steps of each memory launch")
    parser.add_argument("--no-ratios", action="store_true", help="only the memory launches")
    parser.add_argument("--no-memory", action="store_true", help="only the interleaved ratio launches")
    parser.add_argument(
        "--out", default=None, help="report path (default benchmarks/results/<date>-sharding.md)"
    )
    args = parser.parse_args(argv)
    vocab = _vocab()
    started = time.perf_counter()
    mem_rows, ratio_rows, targets = [], [], []
    mib = 1024 * 1024
    for world in args.world_sizes:
        cfg = {
            "vocab": vocab, "dim": args.dim, "depth": args.depth, "batch": args.batch,
            "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
        }  # fmt: skip
        memory = {}
        for kind in [] if args.no_memory else _layouts(world):
            res = run_distributed(memory_worker, world, args=(cfg, kind, args.memory_steps), timeout=1800)
            memory[kind] = res
            print(f"  W={world} {kind}: state {res[0]['state'] / mib:.1f} MiB, step {res[0]['step_s'] * 1e3:.0f} ms",
                  flush=True)  # fmt: skip
        ddp_state = memory["ddp"][0]["state"] if memory else 0
        for kind, res in memory.items():
            r0 = res[0]
            mem_rows.append(
                f"| {world} | {kind} | {r0['state'] / mib:.2f} ({r0['params'] / mib:.1f} + {r0['grads'] / mib:.1f} "
                f"+ {r0['optimizer'] / mib:.1f}) | {r0['state'] / ddp_state:.3f} "
                f"| {'/'.join(format(r['rss_mib'], '.0f') for r in res)} | {r0['step_s'] * 1e3:.0f} |"
            )
        if world == 4 and memory:
            targets.append(
                ("FSDP W=4 model state <= 0.30 of ddp's", memory["fsdp"][0]["state"] / ddp_state, 0.30)
            )
            targets.append(
                ("HSDP 2x2 model state <= 0.55 of ddp's", memory["hsdp"][0]["state"] / ddp_state, 0.55)
            )
        if args.no_ratios:
            continue
        pairs = [("fsdp", "torch_fsdp2")]
        if world >= 4:
            pairs.append(("hsdp", "torch_hsdp2"))
        pairs.append(("torch_fsdp2", "torch_fsdp2"))
        res = run_distributed(ratio_worker, world, args=(cfg, pairs), timeout=3600)[0]
        floor = res["torch_fsdp2/torch_fsdp2"]
        for kind_a, kind_b in pairs[:-1]:
            pair = res[f"{kind_a}/{kind_b}"]
            ratio_rows.append(
                f"| {world} | {kind_a} vs {kind_b} | {pair['a_ms']:.0f} | {pair['b_ms']:.0f} "
                f"| {fmt_ratios(pair['ratios'])} | {fmt_ratios(floor['ratios'])} "
                f"| {res[f'parity {kind_a}/{kind_b}']:.1e} |"
            )
            print(ratio_rows[-1], flush=True)
            targets.append(
                (f"{kind_a} W={world} step time <= 1.05x torch's", statistics.median(pair["ratios"]), 1.05)
            )
    minutes = (time.perf_counter() - started) / 60
    mem_header = (
        "| W | layout | model state MiB, rank 0 (params + grads + optimizer) | / ddp | peak RSS MiB per rank "
        "| step ms (slowest rank) |\n|---|---|---|---|---|---|"
    )
    ratio_header = (
        "| W | pair | lockstep ms/step | torch ms/step | step ratio lockstep/torch, median [min-max] "
        "| noise floor torch/torch (fsdp) | parity (max rel) |\n|---|---|---|---|---|---|---|"
    )
    target_lines = "\n".join(
        f"- {name}: {value:.3f} ({'met' if value <= limit else 'NOT met'})" for name, value, limit in targets
    )
    machine = (
        f"{machine_line()}; TinyGPT dim {args.dim} depth {args.depth} context {CONTEXT} heads {HEADS} vocab "
        f"{vocab}, {args.batch} sequences per rank, AdamW; ratios: {args.rounds} rounds A-B-B-A x {args.steps} "
        f"timed steps (+{args.warmup} warm-up per half); memory launches: {args.memory_steps} timed steps; "
        f"{minutes:.1f} minutes in all"
    )
    report = (
        f"# Sharded engine (FSDP, HSDP): lockstep vs torch's fully_shard ({datetime.date.today()})\n\n"
        f"Machine: {machine}\n\n"
        + (f"## Memory and step time per layout (one launch each)\n\n{mem_header}\n" if mem_rows else "")
        + "\n".join(mem_rows)
        + (
            f"\n\n## Step time against torch's FSDP2 (interleaved, one launch per W)\n\n{ratio_header}\n"
            if ratio_rows
            else ""
        )
        + "\n".join(ratio_rows)
        + f"\n\n## Targets\n\n{target_lines}\n"
    )
    write_report(re.sub(r"\n{3,}", "\n\n", report), "sharding", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
