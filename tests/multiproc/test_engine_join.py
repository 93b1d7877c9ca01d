"""Uneven inputs (issue 4 item 1): join() against torch DDP's join() on the same weights and data.

Ranks have different numbers of batches (3, 5 and 7 on three ranks; 0 and 3, 1 and 4 on two). Ranks
that run out shadow the others' collectives; at the end every rank holds the same parameters, equal to
torch's under the same schedule. Both engines train in the same launch from identical weights.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join

from lockstep.testing import run_distributed
from tests.helpers import batch, build, params_of, wrap

TIMEOUT = 60


def _train(
    kind: str,
    name: str,
    num_batches: list[int],
    *,
    divide: bool = True,
    accumulate: int = 1,
    kwargs: dict[str, Any] | None = None,
    torch_join: bool = False,
    after: int = 0,
    hook: bool = False,
    eval_forward: bool = False,
) -> dict[str, Any]:
    """Train under join() with this rank's number of batches; `after` more even steps once it closes."""
    rank = dist.get_rank()
    module = build(name, seed=rank)  # different init per rank: the wrap makes them equal
    model, handle = wrap(kind, module, **(kwargs or {}))
    if hook:  # torch's stateless hook: a joined rank runs it on zero buckets, as torch does
        handle.register_comm_hook(None, default_hooks.allreduce_hook)
    # momentum buffers differ on a rank that joined early (as with torch): none when training goes on after
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.0 if after else 0.9)
    ctx = (
        Join([handle], divide_by_initial_world_size=divide)
        if torch_join
        else handle.join(divide_by_initial_world_size=divide)
    )
    with ctx:
        for step in range(num_batches[rank]):
            x, y = batch(rank, step)
            if eval_forward:  # a no_grad forward between steps (torch would expect a backward after it)
                with torch.no_grad():
                    model(x)
            sync = (step + 1) % accumulate == 0
            with nullcontext() if sync else handle.no_sync():
                F.cross_entropy(model(x), y).backward()
            if sync:
                opt.step()
                opt.zero_grad()
    for step in range(after):
        x, y = batch(rank, 100 + step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": params_of(module), "buffers": [b.detach().clone() for b in module.buffers()]}


CASES: dict[str, dict[str, Any]] = {
    "convbn": {"name": "convbn"},
    "convbn_divide_false": {"name": "convbn", "divide": False},
    "many_buckets": {"name": "many_small", "kwargs": {"bucket_cap_mb": 0.0005}},
    "unused": {"name": "unused", "kwargs": {"find_unused_parameters": True}},
    "no_sync": {"name": "mlp", "accumulate": 2},
    "then_even": {"name": "mlp", "after": 2},
    "comm_hook": {"name": "many_small", "hook": True, "kwargs": {"bucket_cap_mb": 0.0005}},
    "static_tied": {"name": "tied", "kwargs": {"static_graph": True}},
    "as_view": {"name": "many_small", "kwargs": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005}},
}


def _parity(num_batches: list[int], cases: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        spec = dict(CASES[case])
        name = spec.pop("name")
        for kind in ("ours", "torch"):
            out[f"{case}/{kind}"] = _train(kind, name, num_batches, **spec)
    out["convbn/replicate"] = _train("replicate", "convbn", num_batches)
    out["convbn/ours_under_torch_join"] = _train("ours", "convbn", num_batches, torch_join=True)
    out["eval_forward_inside/ours"] = _train(
        "ours", "convbn", num_batches, eval_forward=True
    )  # no torch reference
    return out


def _check_parity(out: list[dict[str, Any]], cases: list[str]) -> None:
    world = len(out)
    for key in out[0]:
        for what in ("params", "buffers"):
            for rank in range(1, world):  # replicas end identical: the last joiner's model everywhere
                for a, b in zip(out[0][key][what], out[rank][key][what]):
                    assert torch.equal(a, b), f"{key}: {what} of rank {rank} differ from rank 0's"
    for case in [*cases, "convbn/replicate", "convbn/ours_under_torch_join"]:
        ours_key, torch_key = (case, "convbn/torch") if "/" in case else (f"{case}/ours", f"{case}/torch")
        for what in ("params", "buffers"):
            for i, (a, b) in enumerate(zip(out[0][ours_key][what], out[0][torch_key][what])):
                torch.testing.assert_close(
                    a,
                    b,
                    atol=1e-6,
                    rtol=1e-5,
                    msg=lambda m, i=i, w=what, k=ours_key: f"{k} {w}[{i}] vs torch: {m}",
                )


def test_three_ranks_with_3_5_7_batches_match_torch_join() -> None:
    cases = list(CASES)
    out = run_distributed(_parity, 3, args=([3, 5, 7], cases), timeout=TIMEOUT)
    _check_parity(out, cases)


def _with_zero_optimizer(kind: str, num_batches: list[int]) -> dict[str, Any]:
    """torch's own Join manager over the model and a ZeroRedundancyOptimizer (torch's documented usage)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank = dist.get_rank()
    module = build("convbn", seed=rank)
    model, _ = wrap(kind, module)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    with Join([model, opt]):
        for step in range(num_batches[rank]):
            x, y = batch(rank, step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {"params": params_of(module), "buffers": [b.detach().clone() for b in module.buffers()]}


def _two_rank_schedules() -> dict[str, Any]:
    out = {}
    for batches in ([0, 3], [4, 1]):  # rank 0 with no batch at all; rank 1 joins before the bucket rebuild
        for divide in (True, False):
            for kind in ("ours", "torch"):
                out[f"{batches}/{divide}/{kind}"] = _train(kind, "convbn", batches, divide=divide)
    for kind in ("ours", "torch"):
        out[f"zero/{kind}"] = _with_zero_optimizer(kind, [3, 5])
    return out


def test_two_ranks_one_joins_early_or_never_trains() -> None:
    out = run_distributed(_two_rank_schedules, 2, timeout=TIMEOUT)
    for key in out[0]:
        for a, b in zip(out[0][key]["params"], out[1][key]["params"]):
            assert torch.equal(a, b), key
        if key.endswith("ours"):
            theirs = out[0][key.replace("ours", "torch")]
            for a, b in zip(
                out[0][key]["params"] + out[0][key]["buffers"], theirs["params"] + theirs["buffers"]
            ):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # divide_by_initial_world_size changes the result where a rank trains alone
    assert not torch.equal(out[0]["[4, 1]/True/ours"]["params"][0], out[0]["[4, 1]/False/ours"]["params"][0])


def _throw(num_batches: list[int], kind: str, model_name: str) -> dict[str, Any]:
    rank = dist.get_rank()
    module = _syncbn_model() if model_name == "syncbn" else build(model_name, seed=rank)
    model, handle = wrap(kind, module)
    steps = 0
    try:
        with handle.join(throw_on_early_termination=True):
            for step in range(num_batches[rank]):
                x, y = batch(rank, step)
                F.cross_entropy(model(x), y).backward()
                steps += 1
    except RuntimeError as exc:
        return {"error": str(exc), "type": type(exc).__name__, "steps": steps}
    return {"error": None, "steps": steps}


def _syncbn_model() -> nn.Module:
    import lockstep

    torch.manual_seed(0)
    return lockstep.nn.convert_sync_batchnorm(build("convbn", seed=0))


def test_throw_on_early_termination_raises_on_every_rank() -> None:
    out = run_distributed(_throw, 3, args=([3, 5, 7], "ours", "mlp"), timeout=TIMEOUT)
    for rank, result in enumerate(out):
        assert result["type"] == "UnevenInputsError", result
        assert result["steps"] == 3  # every rank stops at the same step
        assert (
            f"[rank {rank}/3] uneven inputs: rank 0 ran out of batches after 3 steps inside join(), "
            "while ranks 1, 2 went on to step 4" in result["error"]
        )


def test_throw_with_syncbatchnorm_in_forward_does_not_hang() -> None:
    out = run_distributed(_throw, 2, args=([4, 2], "replicate", "syncbn"), timeout=TIMEOUT)
    for rank, result in enumerate(out):
        assert result["type"] == "UnevenInputsError", result
        assert result["steps"] == 2
        assert (
            "rank 1 ran out of batches after 2 steps" in result["error"]
            and f"[rank {rank}/2]" in result["error"]
        )
