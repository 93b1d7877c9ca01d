"""Bucket size chosen by measurement (issue 27 item 6): SyncPolicy(bucket_cap_mb="auto") on real gloo.

- the tuner tries every distinct candidate, times each, keeps one of them, and every rank ends with
  the same cap and the same layout;
- at world 2 the gradients and parameters are bitwise those of a fixed-cap run (two-term sums commute:
  the layout cannot change a bit), through every relayout;
- stats() reports the choice and every candidate's timed steps;
- the drop-in class never tunes (it keeps torch's layout and torch's 25 MB).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lockstep
from lockstep.engine.buckets.bucket_tuner import TuningPlan
from lockstep.testing import run_distributed
from tests.helpers import batch, build

TIMEOUT = 90
# Caps small enough that the test model (28 small parameters) gets a distinct layout for each.
PLAN = TuningPlan(caps_mb=(0.0002, 0.0005, 0.002), passes=2, warmup=1, measured=1)
TUNING_STEPS = 2 + 4 * 2 * 2  # the first step, the rebuild's, then 4 candidates (25 MiB too) x 2 passes x 2
STEPS = TUNING_STEPS + 3


def _train(auto: bool, flags: dict[str, bool]) -> dict[str, Any]:
    module = build("many_small", 0)
    cap: float | str = "auto" if auto else 25.0
    handle = lockstep.replicate(module, policy=lockstep.SyncPolicy(bucket_cap_mb=cap, **flags))
    if auto:
        handle._replica.mode.tuner.plan = PLAN  # type: ignore[attr-defined]  # the test's small caps
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    grads, layouts = [], []
    for step in range(STEPS):
        x, y = batch(dist.get_rank(), step)
        F.cross_entropy(module(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]).clone())  # type: ignore[union-attr]
        layouts.append([tuple(b.indices) for b in handle._replica.reducer.buckets])
        opt.step()
        opt.zero_grad()
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in module.parameters()],
        "layouts": layouts,
        "extras": handle.stats().extras,
    }


def _both(flags: dict[str, bool]) -> dict[str, Any]:
    return {"auto": _train(True, flags), "fixed": _train(False, flags)}


@pytest.mark.parametrize(
    "flags",
    [{}, {"gradient_as_bucket_view": True}, {"static_graph": True}, {"find_unused_parameters": True}],
    ids=["default", "grad_as_view", "static_graph", "find_unused"],
)
def test_tuner_tries_every_candidate_agrees_across_ranks_and_keeps_the_bits(flags: dict[str, bool]) -> None:
    outs = run_distributed(_both, 2, args=(flags,), timeout=TIMEOUT)
    for rank, out in enumerate(outs):
        auto, fixed = out["auto"], out["fixed"]
        extras = auto["extras"]
        assert extras["bucket_tuning"] == "done", (rank, extras)
        trials = extras["bucket_trials"]
        assert [t["cap_mb"] for t in trials] == [0.0002, 0.0005, 0.002, 25.0]
        assert len({t["num_buckets"] for t in trials}) == 4  # each candidate a distinct layout
        for t in trials:  # 2 passes x 1 timed step, each the max over ranks, so the same on both
            assert len(t["step_ms"]) == 2 and all(ms > 0 for ms in t["step_ms"]), t
            assert t["median_ms"] == pytest.approx(sum(t["step_ms"]) / 2)
        assert extras["bucket_cap_mb"] in [t["cap_mb"] for t in trials]
        assert extras["bucket_tuning_reason"]
        # the layout really changed during the trials, and the kept one is the chosen cap's
        assert len({len(layout) for layout in auto["layouts"]}) >= 4
        chosen = next(t for t in trials if t["cap_mb"] == extras["bucket_cap_mb"])
        assert len(auto["layouts"][-1]) == chosen["num_buckets"]
        # bitwise equal to the fixed-cap run: every step's averaged gradients and the final parameters
        assert len(auto["grads"]) == len(fixed["grads"]) == STEPS
        for step, (a, f) in enumerate(zip(auto["grads"], fixed["grads"])):
            assert torch.equal(a, f), f"rank {rank} step {step}: gradients differ"
        for a, f in zip(auto["params"], fixed["params"]):
            assert torch.equal(a, f), f"rank {rank}: parameters differ"
        assert "bucket_cap_mb" not in fixed["extras"]  # a fixed cap is not tuned
    # every rank took the same decision from the same numbers, and holds the same layout
    first = outs[0]["auto"]
    for out in outs[1:]:
        assert out["auto"]["extras"]["bucket_trials"] == first["extras"]["bucket_trials"]
        assert out["auto"]["extras"]["bucket_cap_mb"] == first["extras"]["bucket_cap_mb"]
        assert out["auto"]["layouts"] == first["layouts"]


def _dropin() -> dict[str, Any]:
    module = build("many_small", 0)
    model = lockstep.DistributedDataParallel(module)
    for step in range(4):
        x, y = batch(dist.get_rank(), step)
        F.cross_entropy(model(x), y).backward()
    return {
        "tuner": model._engine.mode.tuner,  # type: ignore[attr-defined]
        "extras": model.stats().extras,
        "policy_cap": model._engine.policy.bucket_cap_mb,  # type: ignore[attr-defined]
    }


def test_dropin_class_never_tunes() -> None:
    # torch's layout itself is pinned by test_engine_dropin.py; here: no tuner, torch's 25 MB, no new extras
    for out in run_distributed(_dropin, 2, timeout=TIMEOUT):
        assert out["tuner"] is None and out["policy_cap"] == 25.0
        assert "bucket_trials" not in out["extras"] and "bucket_cap_mb" not in out["extras"]
