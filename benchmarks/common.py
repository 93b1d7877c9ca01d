"""What the benchmark scripts share: models and data, the round protocol, timing, report lines, two-host runs.

- Models: engine_vs_ddp.py's four (`MODELS`: a 25M-parameter MLP, a small ResNet, a GPT, many small
  layers) with their per-rank data and losses, and the 3.2M-parameter MLP that multinode.py and hooks.py
  send over network-namespace links (`link_mlp`).
- The protocol (DESIGN.md): engines compared in rounds whose order alternates (`round_order`, `abba`),
  a step's time is the slowest rank's (`slowest_rank_seconds`), results are per-round ratios reported as
  median [min-max] (`fmt_ratios`), each report says which machine (`machine_line`).
- Two "hosts": `run_pair` runs a script's worker in each of two network namespaces (testbed/netns.py)
  on a link limited by tc, and returns rank 0's JSON result.

The scripts run as `python benchmarks/NAME.py`: each puts the repository root on sys.path to import this
module as `benchmarks.common`, and ranks started by lockstep.testing.run_distributed inherit that path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")

# ---------------------------------------------------------------- engine_vs_ddp.py's models


class MLP(nn.Module):  # ~25M parameters
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(1024, 4096),
            nn.ReLU(),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, 1024),
            nn.ReLU(),
            nn.Linear(1024, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def conv_block(cin: int, cout: int, stride: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
        nn.BatchNorm2d(cout),
    )


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = conv_block(cin, cout, stride)
        self.skip = (
            nn.Identity() if cin == cout and stride == 1 else nn.Conv2d(cin, cout, 1, stride, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class SmallResNet(nn.Module):  # ResNet-style, 32x32 images, ~0.7M parameters
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.layers = nn.Sequential(
            ResBlock(32, 32, 1), ResBlock(32, 64, 2), ResBlock(64, 128, 2), ResBlock(128, 128, 1)
        )
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


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "resnet": SmallResNet,
    "gpt": GPT,
    "many_small": ManySmall,
}


def build(name: str) -> nn.Module:
    """One of MODELS with seed 0's weights (every engine of a comparison starts from these)."""
    torch.manual_seed(0)
    return MODELS[name]()


def batch(name: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of `step` for one of MODELS: the same on every run."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    if name == "mlp":
        return torch.randn(128, 1024, generator=g), torch.randint(0, 10, (128,), generator=g)
    if name == "resnet":
        return torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    if name == "gpt":
        tokens = torch.randint(0, 8192, (8, 129), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)


def loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of a MODELS model (cross-entropy for the classifiers, per token for gpt; MSE for many_small)."""
    if name == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    if name == "many_small":
        return F.mse_loss(out, y)
    return F.cross_entropy(out, y)


# ---------------------------------------------------------------- the link benchmarks' MLP

LINK_BATCH = 32


def link_mlp() -> nn.Module:
    """MLP 1024-1024-1024-1024-10 (3.2M parameters, 12.6 MB of fp32 gradients), seed 0."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def link_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank * 100_000 + step)
    return torch.randn(LINK_BATCH, 1024, generator=gen), torch.randint(0, 10, (LINK_BATCH,), generator=gen)


# ---------------------------------------------------------------- protocol and timing


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """Forward order on even rounds, reversed on odd ones (A-B-..., then ...-B-A): drift hits all alike."""
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def abba(items: Sequence[T], round_index: int) -> list[T]:
    """One round of the A-B-B-A protocol: round_order, then the same reversed (B-A-A-B on odd rounds)."""
    order = round_order(items, round_index)
    return order + order[::-1]


def slowest_rank_seconds(step: Callable[[int], None], warmup: int, steps: int, start: int = 0) -> float:
    """Mean seconds per step over `steps` timed steps after `warmup` untimed ones, as the slowest rank saw it
    (a data-parallel step takes as long as its slowest rank). `step(i)` runs step i; collective."""
    for i in range(warmup):
        step(start + i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(start + warmup + i)
    elapsed = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def paired_rounds(a: Any, b: Any, rounds: int, warmup: int, steps: int) -> dict[str, Any]:
    """Time engines `a` and `b` (each with a `step(i)` method) in A-B-B-A rounds: per round, each runs twice
    (warm-up, then steps // 2 timed steps each time; a step's time is the slowest rank's). Returns the
    per-round ratios a/b and the median ms per step of each."""
    ratios, times_a, times_b = [], [], []
    for r in range(rounds):
        spent: dict[int, list[float]] = {id(a): [], id(b): []}
        for engine in abba((a, b), r):
            spent[id(engine)].append(
                slowest_rank_seconds(engine.step, warmup, steps // 2 or 1, start=100 * r)
            )
        ta, tb = sum(spent[id(a)]), sum(spent[id(b)])
        ratios.append(ta / tb)
        times_a.append(ta / 2)
        times_b.append(tb / 2)
    return {
        "ratios": ratios,
        "a_ms": statistics.median(times_a) * 1e3,
        "b_ms": statistics.median(times_b) * 1e3,
    }


# ---------------------------------------------------------------- report lines


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds one call of `fn` takes, over `calls` calls after one to warm up."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def fmt_ratios(ratios: Sequence[float]) -> str:
    """Per-round ratios as 'median [min-max]'."""
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"


def machine_line() -> str:
    """Where the numbers come from: host, CPU, cores, torch and its threads, backend, OMP_NUM_THREADS."""
    return (
        f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), gloo on CPU, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )


# ---------------------------------------------------------------- two hosts in network namespaces


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """The hidden flags with which run_pair starts SCRIPT on each host."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-json", default="", help=argparse.SUPPRESS)


def run_worker(args: argparse.Namespace, work: Callable[[argparse.Namespace], Any]) -> bool:
    """On a host that run_pair started (`--worker`): join the job, run `work(args)` on this rank, rank 0
    writes its JSON result to --out-json. False (nothing done) in the driver process."""
    if not args.worker:
        return False
    import lockstep  # here: the driver side of the benchmarks never needs a process group

    lockstep.init()
    result = work(args)
    if dist.get_rank() == 0:
        Path(args.out_json).write_text(json.dumps(result))
    dist.destroy_process_group()
    return True


def run_pair(
    script: str,
    rate: str | None,
    argv: Sequence[str],
    out_json: Path,
    *,
    port: int,
    timeout: float,
    delay_ms: float = 0.0,
) -> dict[str, Any]:
    """`python SCRIPT --worker --out-json F ARGS` on each of two namespace hosts, on a link limited to
    `rate` (None: unshaped) and, with delay_ms > 0, delayed that long each way (testbed/netns.py's
    delaying wire; its CPU seconds over the run come back as "wire_cpu_s"); rank 0 writes its JSON result
    to F, returned here. Needs root.

    Each worker gets the env lockstep.init() reads (RANK, WORLD_SIZE, MASTER_ADDR on host 0) and gloo
    bound to its host's veth.
    """
    from testbed.netns import netns_hosts, wire_cpu_seconds

    with netns_hosts(2, rate=rate, delay_ms=delay_ms) as hosts:
        procs = []
        for rank, host in enumerate(hosts):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": hosts[0].addr,
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": host.ifname,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            }
            procs.append(
                host.popen(
                    [sys.executable, script, "--worker", "--out-json", str(out_json), *argv],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
        wire_cpu = wire_cpu_seconds(hosts) if delay_ms else 0.0
    if any(proc.returncode for proc in procs) or not out_json.exists():
        raise RuntimeError(f"link {rate or 'unshaped'}: workers failed: {[o[1][-2000:] for o in outputs]}")
    return {**json.loads(out_json.read_text()), "wire_cpu_s": wire_cpu}


def write_report(report: str, name: str, out: str = "") -> Path:
    """Write a benchmark's report to `out`, or to benchmarks/results/<today>-<name>.md; print where."""
    path = Path(out) if out else Path(__file__).parent / "results" / f"{datetime.date.today()}-{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report)
    print(f"\nwritten to {path}")
    return path
