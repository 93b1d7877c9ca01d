"""Benchmark: communication hooks, lockstep's against torch's, on 2 gloo ranks (issue 4 item 5).

For each hook (none, allreduce, fp16, bf16, PowerSGD rank 1 and 4) on lockstep.DistributedDataParallel with
lockstep.hooks, and on torch's DistributedDataParallel with torch's own hook where torch's works on gloo:
the bytes handed to collectives per step and the step time, on loopback and on a link limited by tc
between two network-namespace hosts (testbed/netns.py, as benchmarks/multinode.py does).

Protocol (DESIGN.md): one launch per link; every configuration built from identical weights, fed identical
data; a gradient parity check first; every configuration warmed up past PowerSGD's start iteration; then
rounds, each running every configuration once (a warm-up step, then timed steps), in forward order on
even rounds and reversed on odd ones (A-B-...-B-A); a step's time is the slowest rank's; ratios are
per-round ratios to torch DDP without a hook in the same round, median [min-max]. "torch (again)" is
torch against itself: the noise floor. Bytes per step: every floating-point tensor handed to
dist.all_reduce / dist.all_gather during one step (a pass-through counter, so torch's hooks are counted
the same way as ours); with no hook both engines all-reduce the fp32 gradients (4 bytes per parameter).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hooks.py                  # loopback + 1gbit + 100mbit (root)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hooks.py --links loopback --rounds 4
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
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmarks.common import (  # noqa: E402
    LINK_BATCH,
    add_worker_flags,
    fmt_ratios,
    link_batch,
    link_mlp,
    machine_line,
    round_order,
    run_pair,
    slowest_rank_seconds,
)
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import lockstep  # noqa: E402
from lockstep import hooks  # noqa: E402
from lockstep.testing import run_distributed, watch_collectives  # noqa: E402

START_POWERSGD_ITER = 2  # torch's minimum with error feedback / warm start
BUCKET_CAP_MB = 25.0
WARMUP_ONCE = START_POWERSGD_ITER + 1  # every configuration is compressing before the rounds start
# (label, engine, hook): hook None = no hook; "torch:" = torch's own hook; else lockstep.hooks'.
CONFIGS: list[tuple[str, str, str | None]] = [
    ("torch", "torch", None),
    ("torch (again)", "torch", None),
    ("lockstep", "lockstep", None),
    ("lockstep allreduce", "lockstep", "allreduce"),
    ("torch allreduce", "torch", "torch:allreduce"),
    ("lockstep fp16", "lockstep", "fp16"),
    ("torch fp16", "torch", "torch:fp16"),
    ("lockstep bf16", "lockstep", "bf16"),
    ("torch bf16", "torch", "torch:bf16"),
    ("lockstep powerSGD r1", "lockstep", "powersgd1"),
    ("torch powerSGD r1", "torch", "torch:powersgd1"),
    ("lockstep powerSGD r4", "lockstep", "powersgd4"),
    ("torch powerSGD r4", "torch", "torch:powersgd4"),
]
HOOK_ROWS = [
    ("none", "lockstep", "torch"),
    ("allreduce", "lockstep allreduce", "torch allreduce"),
    ("fp16", "lockstep fp16", "torch fp16"),
    ("bf16", "lockstep bf16", "torch bf16"),
    ("powerSGD rank 1", "lockstep powerSGD r1", "torch powerSGD r1"),
    ("powerSGD rank 4", "lockstep powerSGD r4", "torch powerSGD r4"),
]


# ---------------------------------------------------------------- per rank


def _hook(spec: str) -> tuple[Any, Callable[..., Any]]:
    """(state, hook) for a hook spec of CONFIGS."""
    theirs = spec.startswith("torch:")
    name = spec.removeprefix("torch:")
    if name.startswith("powersgd"):
        module = torch_powersgd if theirs else hooks
        state = module.PowerSGDState(
            None, matrix_approximation_rank=int(name[-1]), start_powerSGD_iter=START_POWERSGD_ITER
        )
        return state, module.powerSGD_hook
    fn = {"allreduce": "allreduce_hook", "fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook"}[name]
    return (None, getattr(default_hooks, fn)) if theirs else (hooks.HookState(None), getattr(hooks, fn))


def _build(engine: str, hook: str | None, state: dict[str, Any]) -> tuple[Any, Any]:
    module = link_mlp()
    module.load_state_dict(state)
    # 25 MB given explicitly: torch 2.13 then also caps its first bucket at 25 MB (by default at 1 MB), so
    # this 12.6 MB model is one bucket and torch's PowerSGD hook can run on gloo (see the probe).
    cls = lockstep.DistributedDataParallel if engine == "lockstep" else TorchDDP
    model = cls(module, bucket_cap_mb=BUCKET_CAP_MB)
    if hook is not None:
        model.register_comm_hook(*_hook(hook))
    return model, torch.optim.SGD(module.parameters(), lr=0.01)


def _counting_collectives(counted: list[int]) -> AbstractContextManager[None]:
    """Add the bytes of every floating-point tensor handed to all_reduce / all_gather to counted[0].

    Integer tensors (lockstep's agreement on unused parameters, 8 bytes a step) are not gradients and
    are left out. torch's own reducer calls no Python collective.
    """

    def add(tensor: torch.Tensor) -> None:
        if tensor.is_floating_point():
            counted[0] += tensor.numel() * tensor.element_size()

    return watch_collectives(add)


def _train_step(engine: tuple[Any, Any], rank: int, step: int) -> None:
    model, opt = engine
    x, y = link_batch(rank, step)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _one_step(engine: tuple[Any, Any], rank: int, step: int) -> list[torch.Tensor]:
    """One training step; the gradients it applied."""
    model, opt = engine
    x, y = link_batch(rank, step)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.module.parameters()]
    opt.step()
    return grads


def _parity(state: dict[str, Any], rank: int) -> dict[str, float]:
    """Max relative gradient difference after one step from the same weights, lockstep vs torch."""
    out = {}
    for ours, theirs in (("allreduce", None), ("fp16", "torch:fp16")):
        a = _one_step(_build("lockstep", ours, state), rank, 0)
        b = _one_step(_build("torch", theirs, state), rank, 0)
        out[f"lockstep {ours} vs torch {(theirs or 'no hook').removeprefix('torch:')}"] = max(
            float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30) for x, y in zip(a, b)
        )
    return out


def bench_worker(rounds: int, warmup: int, steps: int, skip: list[str]) -> dict[str, Any]:
    rank = dist.get_rank()
    state = link_mlp().state_dict()
    result: dict[str, Any] = {"parity": _parity(state, rank), "bytes": {}, "refused": {}}
    engines: dict[str, tuple[Any, Any]] = {}
    for label, engine, hook in CONFIGS:
        if label in skip:
            result["refused"][label] = skip_reason(label)
            continue
        try:
            built = _build(engine, hook, state)
        except (TypeError, RuntimeError, ValueError) as exc:  # torch's DDP refuses some hooks on CPU
            result["refused"][label] = f"{type(exc).__name__}: {exc}"
            continue
        for i in range(WARMUP_ONCE):
            _one_step(built, rank, i)
        counted = [0]
        with _counting_collectives(counted):
            _one_step(built, rank, WARMUP_ONCE)
        result["bytes"][label] = (
            counted[0] if hook is not None else 4 * sum(p.numel() for p in link_mlp().parameters())
        )
        engines[label] = built
    labels = list(engines)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds):
        for label in round_order(labels, r):
            step = functools.partial(_train_step, engines[label], rank)
            times[label].append(slowest_rank_seconds(step, warmup, steps))
    result["times"] = times
    return result


def skip_reason(label: str) -> str:
    return "aborted gloo in the probe (see below)" if "powerSGD" in label else "skipped"


# ---------------------------------------------------------------- probes: does torch's PowerSGD survive gloo?


def medium_mlp() -> nn.Module:
    """2.1M parameters in several 1 MB buckets (the model of lockstep's own multi-process PowerSGD checks)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def medium_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(32, 256, generator=gen), torch.randn(32, 10, generator=gen)


def probe_worker(model: str, cap_mb: float | None, log_dir: str) -> str:
    """torch's powerSGD_hook on torch's DDP for a few steps; a gloo abort kills the process (the caller sees it).

    stderr goes to a file per rank: gloo's abort message is printed there by C++, not raised.
    """
    log = os.open(os.path.join(log_dir, f"rank{dist.get_rank()}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)
    torch.manual_seed(0)
    module = medium_mlp() if model == "medium" else link_mlp()
    ddp = TorchDDP(module, bucket_cap_mb=cap_mb)
    ddp.register_comm_hook(
        torch_powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
        torch_powersgd.powerSGD_hook,
    )
    for step in range(5):
        if model == "medium":
            x, y = medium_batch(dist.get_rank(), step)
            F.mse_loss(ddp(x), y).backward()
        else:
            x, y = link_batch(dist.get_rank(), step)
            F.cross_entropy(ddp(x), y).backward()
        module.zero_grad()
    return "ran 5 steps"


def probe(model: str, cap_mb: float | None) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            return True, run_distributed(probe_worker, 2, args=(model, cap_mb, log_dir), timeout=60)[0]
        except Exception as exc:  # noqa: BLE001 (the probe reports whatever happened)
            ranks = [
                line.strip().removesuffix(" raised:")
                + (" raised (its peer aborted)" if "raised" in line else "")
                for line in str(exc).splitlines()
                if line.startswith("[rank")
            ]
            logs = "".join(
                Path(log_dir, name).read_text(errors="replace") for name in sorted(os.listdir(log_dir))
            )
            gloo = [line.strip() for line in logs.splitlines() if "Received data size" in line]
            return False, "; ".join(ranks) + (f"; gloo: `{gloo[0][-160:]}`" if gloo else "")


# ---------------------------------------------------------------- links


def run_loopback(args: argparse.Namespace, skip: list[str]) -> dict[str, Any]:
    return run_distributed(
        bench_worker, 2, args=(args.rounds, args.warmup, args.steps, skip), timeout=args.timeout
    )[0]


def run_netns(rate: str, args: argparse.Namespace, skip: list[str], workdir: Path) -> dict[str, Any]:
    rounds, steps = (args.slow_rounds, args.slow_steps) if rate == "100mbit" else (args.rounds, args.steps)
    forward = ["--rounds", str(rounds), "--steps", str(steps), "--warmup", str(args.warmup), "--skip", *skip]
    return run_pair(__file__, rate, forward, workdir / f"hooks-{rate}.json", port=29511, timeout=args.timeout)


def netns_worker(args: argparse.Namespace) -> None:
    lockstep.init(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=300)
    result = bench_worker(args.rounds, args.warmup, args.steps, args.skip)
    dist.barrier()
    if dist.get_rank() == 0:
        Path(args.out_json).write_text(json.dumps(result))
    lockstep.shutdown()


# ---------------------------------------------------------------- report


def _mb(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


def _ratios(times: dict[str, list[float]], label: str, ref: str) -> list[float]:
    return [a / b for a, b in zip(times[label], times[ref])]


def table(res: dict[str, Any]) -> list[str]:
    times, nbytes = res["times"], res["bytes"]
    lines = [
        "| hook | lockstep bytes/step | torch bytes/step | lockstep ms/step | torch ms/step "
        "| lockstep / torch, same hook | lockstep+hook / torch no hook | torch+hook / torch no hook |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for hook, ours, theirs in HOOK_ROWS:
        cells = [hook, _mb(nbytes.get(ours)), _mb(nbytes.get(theirs)) if theirs in times else "refused"]
        for label in (ours, theirs):
            cells.append(f"{1000 * statistics.median(times[label]):.1f}" if label in times else "-")
        cells.append(fmt_ratios(_ratios(times, ours, theirs)) if theirs in times else "-")
        cells.append(fmt_ratios(_ratios(times, ours, "torch")))
        cells.append(fmt_ratios(_ratios(times, theirs, "torch")) if theirs in times else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        f"| noise floor: torch (again) / torch | | | | | {fmt_ratios(_ratios(times, 'torch (again)', 'torch'))} | | |"
    )
    return lines


def report(
    results: dict[str, dict[str, Any]],
    probes: dict[str, tuple[bool, str]],
    args: argparse.Namespace,
    seconds: float,
) -> str:
    n_params = sum(p.numel() for p in link_mlp().parameters())
    lines = [
        f"# Communication hooks: lockstep vs torch, 2 gloo ranks ({datetime.date.today().isoformat()})",
        "",
        f"Machine: {machine_line()}; both ranks on the same cores. Model: benchmarks/common.py's link MLP "
        f"1024-1024-1024-1024-10 ({n_params / 1e6:.2f}M parameters, {4 * n_params / 1e6:.1f} MB of fp32 gradients), "
        f"batch {LINK_BATCH} per rank, SGD, bucket_cap_mb={BUCKET_CAP_MB:g} given to both engines (one bucket; see the "
        f"probes). PowerSGD: start_powerSGD_iter={START_POWERSGD_ITER}, "
        "error feedback and warm start on, min_compression_rate 2. Every configuration warmed up "
        f"{WARMUP_ONCE} steps (compressing before timing); rounds: forward order then reversed, each configuration "
        f"{args.warmup} warm-up + N timed steps per round; a step's time is the slowest rank's; ratios are "
        "per-round ratios, median [min-max]. Run took "
        f"{seconds:.0f} s. `python benchmarks/hooks.py` (as root).",
        "",
        "Bytes/step: floating-point payload handed to dist.all_reduce/all_gather in one step (counted by a "
        "pass-through wrapper; for 2 ranks a ring all-reduce sends that many bytes each way); no hook: the fp32 "
        "gradients.",
        "",
    ]
    for link, res in results.items():
        rounds = args.slow_rounds if link == "100mbit" else args.rounds
        steps = args.slow_steps if link == "100mbit" else args.steps
        lines += [f"## {link} ({rounds} rounds x {steps} timed steps)", "", *table(res), ""]
        parity = ", ".join(f"{k}: {v:.1e}" for k, v in res["parity"].items())
        lines.append(f"Gradient parity (max relative difference, one step): {parity}.")
        for label, why in res["refused"].items():
            lines.append(f"- {label}: not run: {why}")
        lines.append("")
    lines += ["## torch's own powerSGD_hook on gloo (2 CPU ranks, 5 steps, start_powerSGD_iter=2)", ""]
    for what, (ok, text) in probes.items():
        lines.append(f"- {what}: {'works' if ok else 'FAILS'}: {text}")
    lines += [
        "",
        "Notes:",
        "- lockstep+hook / torch no hook is the speed-up the hook buys on that link; lockstep / torch, same "
        "hook compares the engines (and the hooks' implementations) at equal bytes.",
        "- torch's DDP refuses a hook named bf16_compress_hook unless CUDA and NCCL >= 2.10 are present, so "
        "there is no torch bf16 row on CPU; lockstep's bf16 hook runs on gloo.",
        "- torch's PowerSGD on several buckets fails either way on gloo: an abort (a size mismatch) or a hang "
        "(both ranks killed at the probe's 60 s timeout), depending on how the ranks' collectives interleave; "
        "lockstep's runs on the same models (its multi-process hook checks).",
        "- Both ranks share 2 cores: compression costs CPU that the all-reduce would otherwise compete for; on "
        "loopback it does not pay, on a slow link it does.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_worker_flags(parser)
    parser.add_argument("--skip", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--links", nargs="+", default=["loopback", "1gbit", "100mbit"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration per round")
    parser.add_argument("--slow-rounds", type=int, default=4, help="rounds at 100mbit")
    parser.add_argument("--slow-steps", type=int, default=2, help="timed steps per round at 100mbit")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--out", default=None, help="report path (default benchmarks/results/<date>-hooks.md)"
    )
    args = parser.parse_args()
    if args.worker:
        netns_worker(args)
        return
    started = time.time()
    probes = {
        f"this benchmark's MLP, bucket_cap_mb={BUCKET_CAP_MB:g} given (one bucket)": probe(
            "bench", BUCKET_CAP_MB
        ),
        "this benchmark's MLP, torch's default buckets (first bucket 1 MB: two buckets)": probe(
            "bench", None
        ),
        "2.1M-parameter MLP (lockstep's PowerSGD checks), bucket_cap_mb=1 (several buckets)": probe(
            "medium", 1.0
        ),
    }
    print(probes, file=sys.stderr, flush=True)
    skip = (
        []
        if next(iter(probes.values()))[0]
        else [label for label, _, hook in CONFIGS if hook and hook.startswith("torch:powersgd")]
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for link in args.links:
            t0 = time.time()
            results[link] = (
                run_loopback(args, skip) if link == "loopback" else run_netns(link, args, skip, Path(tmp))
            )
            print(f"{link}: done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            print("\n".join(table(results[link])), file=sys.stderr, flush=True)
    text = report(results, probes, args, time.time() - started)
    out = (
        Path(args.out)
        if args.out
        else ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-hooks.md"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
