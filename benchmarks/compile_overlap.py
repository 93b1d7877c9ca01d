"""Benchmark: how much of the gradient communication hides behind backward, eager and under torch.compile.

Arms, on identical weights and batches, each training with SGD:
- `torch` / `torch+compile`: torch's DistributedDataParallel around the module, eager / around
  `torch.compile(module)` (dynamo's DDPOptimizer splits the compiled graph at bucket boundaries);
- `lockstep` / `lockstep+compile`: lockstep.DistributedDataParallel, the same two ways (lockstep sets
  what torch's DDP sets for dynamo: engine/dropin/compile_support.py);
- `lockstep+compile-unsplit`: the compiled arm with `torch._dynamo.config.optimize_ddp=False`, dynamo's
  whole graph: what lockstep did before compile_support.py (main at 15b8c82 never split);
- `replicate` / `replicate+compile`: `lockstep.replicate(module)` / `lockstep.replicate(torch.compile(module))`
  (lockstep's own bucket layout, not torch's);
- `torch+compile-again` (not in the default run): torch's compiled arm a second time, for the noise floor
  (`--models mlp --arms torch+compile,torch+compile-again`).

Every arm reduces through the same communication hook, torch's `allreduce_hook` wrapped to stamp each
bucket's launch and, in the future's callback, its completion; a post-accumulate-grad hook on every
parameter stamps the last gradient of the backward (the end of backward's compute). Per step:
- comm_ms: the wall time during which at least one bucket's all-reduce was in flight (union of the
  buckets' [launch, done] intervals);
- hidden_ms: the part of comm_ms before the last gradient was accumulated (overlapped with compute);
- hidden = hidden_ms / comm_ms (1: all communication hidden; 0: none started before backward ended);
- exposed_ms = comm_ms - hidden_ms: communication that backward() waits for after computing.
The same instrumentation for every arm; each rank measures its own steps, the table shows the median
over ranks and steps of each round, then the median over rounds [min-max]. Step time: the slowest
rank's, per round; the ratio lockstep/torch within the same compile setting, per round.

Protocol (DESIGN.md): one launch per model; rounds in A-B-...-B-A order; warm-up steps then timed steps;
parity: after the rounds, every arm has run the same steps on the same batches, and the parameters of
each arm are compared with torch's of the same compile setting (max |difference|, 0 = bit for bit).

    OMP_NUM_THREADS=1 python benchmarks/compile_overlap.py            # mlp and gpt, 4 rounds: ~4 minutes
    OMP_NUM_THREADS=1 python benchmarks/compile_overlap.py --models mlp --rounds 6 --out report.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchmarks.common import batch, build, fmt_ratios, loss, machine_line, round_order  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import lockstep  # noqa: E402
from lockstep.engine.core.stats import union_ms  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

ARMS = (
    "torch",
    "lockstep",
    "torch+compile",
    "lockstep+compile",
    "lockstep+compile-unsplit",
    "replicate",
    "replicate+compile",
)
LR = 1e-3
GPT_SEQUENCES = 4

# ---------------------------------------------------------------- per rank


class Probe:
    """Stamps each bucket's launch and completion (through the communication hook) and the backward's
    last accumulated gradient; one step's overlap from them."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.launched: list[float] = []
        self.done: list[float] = []
        self.last_grad = 0.0
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, _param: torch.Tensor) -> None:
        self.last_grad = time.perf_counter()

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # torch's check wants no string annotation
        i = len(self.launched)
        self.launched.append(time.perf_counter())
        self.done.append(0.0)

        def stamp(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self.done[i] = time.perf_counter()
            return fut.value()

        return allreduce_hook(state, bucket).then(stamp)

    def take(self) -> dict[str, float]:
        """This step's comm_ms, hidden_ms and number of buckets; then ready for the next step."""
        spans = list(zip(self.launched, self.done))
        out = {
            "comm_ms": union_ms(spans),
            "hidden_ms": union_ms(spans, until=self.last_grad),
            "buckets": float(len(spans)),
        }
        self.launched, self.done = [], []
        return out


class Arm:
    def __init__(self, kind: str, name: str, state: dict[str, torch.Tensor], backend: str) -> None:
        self.kind, self.name = kind, name
        self.module = build(name)
        self.module.load_state_dict(state)
        self.probe = Probe(list(self.module.parameters()))
        self.unsplit = kind.endswith("unsplit")
        inner: Any = self.module
        if "compile" in kind:
            # dynamo shares compiled code between instances of a class (guarded on the backend): the
            # unsplit arm gets a backend of its own, or it would run the split graph of another arm
            inner = torch.compile(self.module, backend=_unsplit(backend) if self.unsplit else backend)
        if kind.startswith("replicate"):
            owner: Any = lockstep.replicate(inner)
            self.model: Any = inner
        else:
            cls = TorchDDP if kind.startswith("torch") else lockstep.DistributedDataParallel
            owner = self.model = cls(inner)
        owner.register_comm_hook(None, self.probe.hook)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR)
        self.records: list[dict[str, float]] = []

    def step(self, i: int) -> None:
        x, y = batch(self.name, dist.get_rank(), i)
        if self.name == "gpt":  # GPT_SEQUENCES of common.py's 8 sequences: the default run fits 4 minutes
            x, y = x[:GPT_SEQUENCES], y[:GPT_SEQUENCES]
        # dynamo reads optimize_ddp when it compiles (the first steps): the unsplit arm compiles whole
        with torch._dynamo.config.patch(optimize_ddp=not self.unsplit):
            out = self.model(x)
        value = loss(self.name, out, y)
        pieces = compiled_pieces(value)
        value.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.records.append({**self.probe.take(), "pieces": float(pieces)})


def _unsplit(backend: str) -> Any:
    compile_fn = torch._dynamo.lookup_backend(backend)

    def unsplit(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        return compile_fn(gm, example_inputs)

    return unsplit


def compiled_pieces(root: torch.Tensor) -> int:
    """How many compiled graphs (AOTAutograd backward nodes) the backward of `root` runs."""
    seen, stack, count = set(), [root.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__.startswith("CompiledFunction")
        stack.extend(n for n, _ in node.next_functions)
    return count


def _timed(arm: Arm, warmup: int, steps: int, start: int) -> tuple[float, list[dict[str, float]]]:
    for i in range(warmup):
        arm.step(start + i)
    arm.records = []
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        arm.step(start + warmup + i)
    elapsed = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()), list(arm.records)


def measure(name: str, arms: list[str], rounds: int, warmup: int, steps: int, backend: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch._dynamo.reset()
    state = build(name).state_dict()
    built = {kind: Arm(kind, name, state, backend) for kind in arms}
    t_compile = {}
    for kind, arm in built.items():  # the first step compiles: not timed, and the same step for every arm
        t0 = time.perf_counter()
        arm.step(0)
        t_compile[kind] = time.perf_counter() - t0
    per_round: dict[str, list[dict[str, Any]]] = {kind: [] for kind in arms}
    step_index = 1
    for r in range(rounds):
        for kind in round_order(arms, r):
            seconds, records = _timed(built[kind], warmup, steps, start=step_index)
            per_round[kind].append({"step_s": seconds, "records": records})
        step_index += warmup + steps
    params = {kind: [p.detach().clone() for p in arm.module.parameters()] for kind, arm in built.items()}
    parity = {}
    for kind in arms:
        ref = "torch+compile" if "compile" in kind else "torch"
        if ref in params and kind != ref:
            parity[kind] = max((a - b).abs().max().item() for a, b in zip(params[kind], params[ref]))
    return {"rounds": per_round, "parity": parity, "compile_s": t_compile}


# ---------------------------------------------------------------- report


def _round_medians(rank_rounds: list[list[dict[str, Any]]], key: str) -> list[float]:
    """Per round, the median over ranks and timed steps of `key` (hidden: a fraction)."""
    out = []
    for r in range(len(rank_rounds[0])):
        values = []
        for rounds in rank_rounds:
            for rec in rounds[r]["records"]:
                if key == "hidden":
                    values.append(rec["hidden_ms"] / rec["comm_ms"] if rec["comm_ms"] > 0 else 0.0)
                elif key == "exposed_ms":
                    values.append(rec["comm_ms"] - rec["hidden_ms"])
                else:
                    values.append(rec[key])
        out.append(statistics.median(values))
    return out


def _fmt(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def report(name: str, results: list[dict[str, Any]], arms: list[str]) -> list[str]:
    lines = [
        f"### {name}",
        "",
        "| arm | hidden fraction | comm ms/step | exposed ms/step | buckets | graph pieces | step ms "
        "| step vs torch (same compile) | max abs diff vs torch | first step s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rank0 = results[0]
    for kind in arms:
        rank_rounds = [res["rounds"][kind] for res in results]
        step_s = [rd["step_s"] for rd in rank0["rounds"][kind]]
        ref = "torch+compile" if "compile" in kind else "torch"
        ratio = "1 (reference)" if kind == ref else "-"
        if kind != ref and ref in rank0["rounds"]:
            ref_s = [rd["step_s"] for rd in rank0["rounds"][ref]]
            ratio = fmt_ratios([a / b for a, b in zip(step_s, ref_s)])
        diff = rank0["parity"].get(kind)
        lines.append(
            f"| {kind} | {_fmt(_round_medians(rank_rounds, 'hidden'))} "
            f"| {_fmt(_round_medians(rank_rounds, 'comm_ms'), 1)} "
            f"| {_fmt(_round_medians(rank_rounds, 'exposed_ms'), 1)} "
            f"| {statistics.median(_round_medians(rank_rounds, 'buckets')):.0f} "
            f"| {statistics.median(_round_medians(rank_rounds, 'pieces')):.0f} "
            f"| {statistics.median(step_s) * 1e3:.0f} | {ratio} "
            f"| {'-' if diff is None else f'{diff:.3g}'} | {rank0['compile_s'][kind]:.1f} |"
        )
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--backend", default="aot_eager", help="torch.compile backend (inductor: slow to compile)"
    )
    parser.add_argument("--out", default="", help="results file (default: none, print only)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    started = time.perf_counter()
    lines = [
        f"Machine: {machine_line()}; world 2; torch.compile backend {args.backend}; SGD; "
        f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed steps) per arm; gpt on "
        f"{GPT_SEQUENCES} sequences of 128 tokens per rank.",
        "",
    ]
    for name in args.models.split(","):
        results = run_distributed(
            measure, 2, args=(name, arms, args.rounds, args.warmup, args.steps, args.backend), timeout=900
        )
        block = report(name, results, arms)
        print("\n".join(block), flush=True)
        lines += block
    lines.append(f"Total run time {time.perf_counter() - started:.0f} s.")
    print(lines[-1])
    if args.out:
        Path(args.out).write_text(
            f"# Communication hidden behind backward, eager and compiled ({datetime.date.today()})\n\n"
            + "\n".join(lines)
            + "\n"
        )


if __name__ == "__main__":
    main()
