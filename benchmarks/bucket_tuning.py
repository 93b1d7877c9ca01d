"""Benchmark: the bucket size chosen by measurement (SyncPolicy(bucket_cap_mb="auto")) against a fixed 25 MB.

Three engines per model, all `lockstep.replicate` from the same weights, fed the same batches, SGD:
- `tuned`: bucket_cap_mb="auto"; it first runs its tuning steps (each distinct candidate cap in two
  passes, engine/buckets/bucket_tuner.py), which are timed apart (the tuning's own cost);
- `fixed` and `fixed2`: bucket_cap_mb=25 (torch's default), fixed2 only for the noise floor.
After the tuning the fixed engines take the tuned one's weights and one step of each is checked for equal
gradients (bitwise at world 2). Then rounds in A-B-C-C-B-A order, each block a warm-up step then timed
steps, a step's time the slowest rank's: the median of per-round ratios tuned/fixed with its min-max, and
fixed2/fixed as the noise floor. A model whose candidate caps all give one layout (mlp: its large weights
are reduced in place whatever the cap) has nothing to tune and is not timed.

Shorter than DESIGN.md's protocol (3 rounds of 2 timed steps by default, not 6 of 10) to fit 3 minutes
on a loaded 2-core machine; pass --rounds and --steps for more.

    OMP_NUM_THREADS=1 python benchmarks/bucket_tuning.py --models gpt resnet mlp
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
from benchmarks.common import abba, batch, build, fmt_ratios, loss, machine_line, slowest_rank_seconds  # noqa: E402

import lockstep  # noqa: E402
from lockstep.testing import run_distributed  # noqa: E402

LR = 1e-4
MAX_TUNING_STEPS = 80


class _Engine:
    def __init__(self, name: str, cap: float | str) -> None:
        self.name = name
        self.module = build(name)
        self.handle = lockstep.replicate(self.module, policy=lockstep.SyncPolicy(bucket_cap_mb=cap))
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR)

    def step(self, i: int) -> None:
        x, y = batch(self.name, dist.get_rank(), i)
        loss(self.name, self.module(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def grads_after_one_step(self, i: int) -> list[torch.Tensor]:
        x, y = batch(self.name, dist.get_rank(), i)
        loss(self.name, self.module(x), y).backward()
        grads = [p.grad.clone() for p in self.module.parameters()]  # type: ignore[union-attr]
        self.opt.zero_grad(set_to_none=False)
        return grads


def _compare(name: str, rounds: int, steps: int) -> dict[str, Any]:
    tuned = _Engine(name, "auto")
    t0, tuning_steps = time.perf_counter(), 0
    while tuned.handle.stats().extras["bucket_tuning"] != "done" and tuning_steps < MAX_TUNING_STEPS:
        tuned.step(tuning_steps)
        tuning_steps += 1
    tuning_s = time.perf_counter() - t0
    extras = tuned.handle.stats().extras
    out: dict[str, Any] = {
        "tuning": {k: extras[k] for k in ("bucket_cap_mb", "bucket_tuning_reason", "bucket_trials")},
        "tuning_steps": tuning_steps,
        "tuning_s": tuning_s,
        "num_buckets": len(tuned.handle.stats().bucket_sizes_bytes),
    }
    if len(extras["bucket_trials"]) < 2:
        return out  # one layout whatever the cap: nothing was tuned, nothing to time
    fixed, fixed2 = _Engine(name, 25.0), _Engine(name, 25.0)
    state = tuned.module.state_dict()
    for engine in (fixed, fixed2):
        engine.module.load_state_dict(state)
    reference = tuned.grads_after_one_step(10_000)
    for engine in (fixed, fixed2):
        got = engine.grads_after_one_step(10_000)
        out.setdefault("parity_bitwise", True)
        out["parity_bitwise"] &= all(torch.equal(a, b) for a, b in zip(reference, got))
    spent: dict[str, list[float]] = {"tuned": [], "fixed": [], "fixed2": []}
    engines = {"tuned": tuned, "fixed": fixed, "fixed2": fixed2}
    ratios, floor = [], []
    for r in range(rounds):
        block: dict[str, float] = {k: 0.0 for k in engines}
        for key in abba(list(engines), r):
            block[key] += slowest_rank_seconds(engines[key].step, 1, steps, start=200 * r)
        for key, value in block.items():
            spent[key].append(value / 2)
        ratios.append(block["tuned"] / block["fixed"])
        floor.append(block["fixed2"] / block["fixed"])
    out.update(
        ratios=ratios,
        floor=floor,
        tuned_ms=statistics.median(spent["tuned"]) * 1e3,
        fixed_ms=statistics.median(spent["fixed"]) * 1e3,
    )
    return out


def _trials_text(trials: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{t['cap_mb']:g} MiB ({t['num_buckets']} b): {t['median_ms']:.0f}"
        if t["median_ms"]
        else f"{t['cap_mb']:g}"
        for t in trials
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet", "mlp"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per block (after 1 warm-up)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for name in args.models:
        res = run_distributed(_compare, 2, args=(name, args.rounds, args.steps), timeout=600)[0]
        t = res["tuning"]
        timed = "ratios" in res
        rows.append(
            f"| {name} | {_trials_text(t['bucket_trials'])} | {t['bucket_cap_mb']:g} | "
            f"{res['tuning_steps']} steps, {res['tuning_s']:.1f} s | "
            + (
                f"{res['tuned_ms']:.1f} | {res['fixed_ms']:.1f} | {fmt_ratios(res['ratios'])} | "
                f"{fmt_ratios(res['floor'])} | {'yes' if res['parity_bitwise'] else 'NO'} |"
                if timed
                else "- | - | one layout at every cap: not timed | - | - |"
            )
        )
        print(rows[-1], f"({t['bucket_tuning_reason']})", flush=True)
    header = (
        "| model | candidates: cap (buckets): median backward+finalize ms, max over ranks | chosen MiB | tuning "
        "| tuned ms/step | fixed 25 MiB ms/step | step ratio tuned/fixed, median [min-max] | noise floor "
        "fixed/fixed | grads bitwise equal |\n|---|---|---|---|---|---|---|---|---|"
    )
    table = "\n".join([header, *rows])
    print(table)
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.out:
        day = datetime.date.today().isoformat()
        Path(args.out).write_text(
            f"# Bucket size chosen by measurement vs a fixed 25 MiB ({day})\n\nMachine: {machine_line()}; "
            f"world 2; {args.rounds} rounds A-B-C-C-B-A x {args.steps} timed steps (+1 warm-up)\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
