"""Benchmark: lockstep's engine against torch's DistributedDataParallel, gloo on CPU (issue 3).

Protocol (DESIGN.md): one launch per model and world size; both engines built from identical weights
and fed identical data; a gradient parity check before timing; rounds in A-B-B-A order, each a few
warm-up steps then timed steps; a step's time is the slowest rank's (all-reduce MAX); the median of
per-round ratios lockstep/torch with its min-max; the same protocol with torch on both sides gives the
noise floor. Peak RSS per rank comes from separate launches, interleaved, median of several per engine.

    OMP_NUM_THREADS=1 python benchmarks/engine_vs_ddp.py --models mlp --rounds 6 --world-sizes 1 2
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from lockstep.testing import run_distributed

# ---------------------------------------------------------------- models


class MLP(nn.Module):  # ~25M parameters
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                                 nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _block(cin: int, cout: int, stride: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = _block(cin, cout, stride)
        self.skip = nn.Identity() if cin == cout and stride == 1 else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class SmallResNet(nn.Module):  # ResNet-style, 32x32 images, ~0.7M parameters
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.layers = nn.Sequential(ResBlock(32, 32, 1), ResBlock(32, 64, 2), ResBlock(64, 128, 2), ResBlock(128, 128, 1))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


class GPT(nn.Module):  # ~10M parameters, sequence 128
    def __init__(self, vocab: int = 8192, d: int = 256, layers: int = 8, seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.norm(self.blocks(h, mask=self.mask, is_causal=True)))


class ManySmall(nn.Module):  # hundreds of tiny layers: the per-hook cost
    def __init__(self, depth: int = 400, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def _data(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    if name == "mlp":
        return torch.randn(128, 1024, generator=g), torch.randint(0, 10, (128,), generator=g)
    if name == "resnet":
        return torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    if name == "gpt":
        tokens = torch.randint(0, 8192, (8, 129), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)


MODELS = {"mlp": MLP, "resnet": SmallResNet, "gpt": GPT, "many_small": ManySmall}


def _loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    if name == "many_small":
        return F.mse_loss(out, y)
    return F.cross_entropy(out, y)


# ---------------------------------------------------------------- per rank


class _Engine:
    def __init__(self, kind: str, name: str, state: dict[str, torch.Tensor]) -> None:
        torch.manual_seed(0)
        self.module = MODELS[name]()
        self.module.load_state_dict(state)
        cls = lockstep.DistributedDataParallel if kind == "lockstep" else TorchDDP
        self.model = cls(self.module)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-4)
        self.name = name

    def step(self, step: int) -> None:
        x, y = _data(self.name, dist.get_rank(), step)
        self.opt.zero_grad(set_to_none=True)
        _loss(self.name, self.model(x), y).backward()
        self.opt.step()


def _timed(engine: _Engine, warmup: int, steps: int, start: int) -> float:
    for i in range(warmup):
        engine.step(start + i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        engine.step(start + warmup + i)
    elapsed = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step takes as long as the slowest rank
    return float(elapsed.item())


def _parity(a: _Engine, b: _Engine) -> float:
    worst = 0.0
    for engine in (a, b):
        engine.opt.zero_grad(set_to_none=True)
        x, y = _data(engine.name, dist.get_rank(), 0)
        _loss(engine.name, engine.model(x), y).backward()
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        scale = float(pb.grad.abs().max()) or 1.0
        worst = max(worst, float((pa.grad - pb.grad).abs().max()) / scale)
    if worst > 1e-4:
        raise RuntimeError(f"gradient parity check failed: max relative difference {worst:.3g}")
    return worst


def bench_worker(name: str, rounds: int, warmup: int, steps: int, pairs: list[str]) -> dict[str, Any]:
    torch.manual_seed(0)
    state = MODELS[name]().state_dict()
    result: dict[str, Any] = {}
    for pair in pairs:
        kind_a = "lockstep" if pair == "lockstep/torch" else "torch"
        a, b = _Engine(kind_a, name, state), _Engine("torch", name, state)
        result[f"parity {pair}"] = _parity(a, b)
        ratios, times_a, times_b = [], [], []
        for r in range(rounds):
            order = (a, b, b, a) if r % 2 == 0 else (b, a, a, b)
            spent: dict[int, list[float]] = {id(a): [], id(b): []}
            for engine in order:
                spent[id(engine)].append(_timed(engine, warmup, steps // 2 or 1, start=100 * r))
            ta, tb = sum(spent[id(a)]), sum(spent[id(b)])
            ratios.append(ta / tb)
            times_a.append(ta / 2)
            times_b.append(tb / 2)
        result[pair] = {"ratios": ratios, "a_ms": statistics.median(times_a) * 1e3,
                        "b_ms": statistics.median(times_b) * 1e3}
        if kind_a == "lockstep":
            stats = a.model.stats()
            result["lockstep_stats"] = None if stats.mean is None else {
                "comm_ms": stats.mean.comm_ms, "hidden_ms": stats.mean.comm_hidden_ms,
                "finalize_ms": stats.mean.finalize_ms, "num_buckets": stats.num_buckets,
                "backward_ms": stats.mean.backward_ms, "forward_ms": stats.mean.forward_ms,
            }
        del a, b
    return result


def memory_worker(name: str, kind: str, steps: int) -> float:
    torch.manual_seed(0)
    engine = _Engine(kind, name, MODELS[name]().state_dict())
    for i in range(steps):
        engine.step(i)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB


# ---------------------------------------------------------------- driver


def _memory_ratio(name: str, world: int, launches: int) -> str:
    """Median peak RSS over interleaved launches: one launch's peak moves by +-5% with the allocator's luck."""
    peaks: dict[str, list[float]] = {"lockstep": [], "torch": []}
    for i in range(launches):
        for kind in ("lockstep", "torch") if i % 2 == 0 else ("torch", "lockstep"):
            peaks[kind].append(max(run_distributed(memory_worker, world, args=(name, kind, 4), timeout=600)))
    ours, theirs = statistics.median(peaks["lockstep"]), statistics.median(peaks["torch"])
    return f"{ours / theirs:.3f} ({ours:.0f}/{theirs:.0f} MiB, median of {launches})"


def _fmt(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine per round")
    parser.add_argument("--no-noise-floor", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-launches", type=int, default=3, help="launches per engine for peak RSS")
    parser.add_argument("--out", default=None, help="report path (default benchmarks/results/<date>-engine_vs_ddp.md)")
    args = parser.parse_args(argv)
    pairs = ["lockstep/torch"] + ([] if args.no_noise_floor else ["torch/torch"])
    rows = []
    for name in args.models:
        for world in args.world_sizes:
            res = run_distributed(bench_worker, world, args=(name, args.rounds, args.warmup, args.steps, pairs),
                                  timeout=1800)[0]
            mem = ""
            if not args.no_memory:
                mem = _memory_ratio(name, world, args.memory_launches)
            main_pair = res["lockstep/torch"]
            floor = _fmt(res["torch/torch"]["ratios"]) if "torch/torch" in res else "-"
            st = res.get("lockstep_stats") or {}
            row = (f"| {name} | {world} | {main_pair['a_ms']:.1f} | {main_pair['b_ms']:.1f} | {_fmt(main_pair['ratios'])} "
                   f"| {floor} | {mem or '-'} | {res['parity lockstep/torch']:.1e} "
                   f"| {st.get('num_buckets', '-')} | {st.get('comm_ms', 0):.1f}/{st.get('hidden_ms', 0):.1f} |")
            print(row, flush=True)
            rows.append(row)
    header = ("| model | world | lockstep ms/step | torch ms/step | step ratio lockstep/torch, median [min-max] "
              "| noise floor torch/torch | peak RSS ratio (lockstep/torch) | grad parity (max rel) "
              "| buckets | lockstep comm/hidden ms |\n|---|---|---|---|---|---|---|---|---|---|")
    machine = (f"{platform.node()}: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
               f"cpu count {__import__('os').cpu_count()}, torch {torch.__version__}, backend gloo, OMP_NUM_THREADS=1, "
               f"{args.rounds} rounds A-B-B-A x {args.steps} timed steps (+{args.warmup} warm-up)")
    report = f"# lockstep engine vs torch DDP ({_dt.date.today()})\n\nMachine: {machine}\n\n{header}\n" + "\n".join(rows) + "\n"
    out = Path(args.out or Path(__file__).parent / "results" / f"{_dt.date.today()}-engine_vs_ddp.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
