"""lockstep.nn.SyncBatchNorm on real gloo ranks against single-process BatchNorm on the concatenated batch.

Oracle: torch's own SyncBatchNorm refuses CPU tensors in training, so the reference is one process
running torch.nn.BatchNorm{1,2,3}d on the concatenation of every rank's batch, in rank order.

Gradient convention: the global loss is L = sum over ranks r of L_r with L_r = sum_i R_i * y_i over
this rank's samples (R fixed random weights). Then
  - each rank's input gradient is its slice of dL/dx of the single-process loss (the backward
    all-reduce carries the other ranks' share of the statistics' gradients);
  - each rank's weight/bias gradient is dL_r/dw, its own share, and their SUM over ranks equals the
    single-process dL/dw (a DDP engine then sums or averages them; we sum, then take an SGD step, so
    later steps check the running statistics and outputs after parameter updates).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.errors import ConfigError
from lockstep.nn import SyncBatchNorm, convert_sync_batchnorm
from lockstep.testing import run_distributed

TOL = {"atol": 1e-5, "rtol": 1e-5}
LR = 0.1


# ---------------------------------------------------------------- cases and the single-process oracle


def _case(shape: tuple[int, ...], sizes: list[int], **kw: Any) -> dict[str, Any]:
    """Full inputs for `steps` steps and the initial layer state; ranks take their slice by `sizes`."""
    gen = torch.Generator().manual_seed(kw.pop("seed", 0))
    steps = kw.pop("steps", 3)
    offset = kw.pop("offset", 0.5)
    dtype = kw.pop("dtype", torch.float32)
    opts = {"momentum": 0.1, "affine": True, "track_running_stats": True, "bias": True, **kw}
    total = sum(sizes)
    xs = [(torch.randn(total, *shape, generator=gen) * 2 + offset).to(dtype) for _ in range(steps)]
    rs = [torch.randn(total, *shape, generator=gen).to(dtype) for _ in range(steps)]
    layer = _torch_bn(len(shape) + 1, shape[0], opts)
    if layer.affine:
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5, generator=gen)
            if layer.bias is not None:
                layer.bias.uniform_(-0.5, 0.5, generator=gen)
    return {"sizes": sizes, "opts": opts, "xs": xs, "rs": rs, "state": layer.state_dict(), "grad_x": True}


def _torch_bn(ndim: int, channels: int, opts: dict[str, Any]) -> torch.nn.Module:
    cls = {
        2: torch.nn.BatchNorm1d,
        3: torch.nn.BatchNorm1d,
        4: torch.nn.BatchNorm2d,
        5: torch.nn.BatchNorm3d,
    }[ndim]
    return cls(channels, **opts)


def _steps(
    layer: torch.nn.Module,
    xs: list[torch.Tensor],
    rs: list[torch.Tensor],
    grad_x: bool,
    reduce_grads: Any = None,
) -> dict[str, Any]:
    """Forward, backward of sum(R * y), (reduce param grads), SGD step; record everything per step."""
    out: dict[str, Any] = {"y": [], "gx": [], "gw": [], "gb": []}
    params = [p for p in (getattr(layer, "weight", None), getattr(layer, "bias", None)) if p is not None]
    for x, r in zip(xs, rs):
        x = x.clone().requires_grad_(grad_x)
        y = layer(x)
        (y.float() * r.float()).sum().backward()
        out["y"].append(y.detach())
        out["gx"].append(x.grad)
        out["gw"].append(None if layer.weight is None else layer.weight.grad.clone())
        out["gb"].append(None if layer.bias is None else layer.bias.grad.clone())
        if reduce_grads is not None:
            reduce_grads(params)
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
    out["state"] = {k: v.clone() for k, v in layer.state_dict().items()}
    return out


def _oracle(case: dict[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    xs = case["xs"]
    layer = _torch_bn(xs[0].dim(), xs[0].shape[1], case["opts"]).to(dtype)
    layer.load_state_dict(case["state"])
    return _steps(layer, [x.to(dtype) for x in xs], [r.to(dtype) for r in case["rs"]], case["grad_x"])


# ---------------------------------------------------------------- what each rank runs


def _rank_run(case: dict[str, Any], group: Any = None, index: int | None = None) -> dict[str, Any]:
    """Train lockstep's layer on this rank's slice (`index` = position in the group, default the rank)."""
    index = dist.get_rank() if index is None else index
    sizes = case["sizes"]
    lo, hi = sum(sizes[:index]), sum(sizes[: index + 1])
    xs = case["xs"][0]
    layer = SyncBatchNorm(xs.shape[1], process_group=group, **case["opts"])
    layer.load_state_dict(case["state"])

    def sum_grads(params: list[torch.Tensor]) -> None:
        for p in params:
            dist.all_reduce(p.grad, group=group)

    return _steps(
        layer, [x[lo:hi] for x in case["xs"]], [r[lo:hi] for r in case["rs"]], case["grad_x"], sum_grads
    )


def _run_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_rank_run(case) for case in cases]


def _compare(
    case: dict[str, Any],
    per_rank: list[dict[str, Any]],
    expected: dict[str, Any],
    tol: dict[str, float] = TOL,
    grad_tol: dict[str, float] | None = None,
) -> None:
    grad_tol = grad_tol or tol
    for step in range(len(case["xs"])):
        torch.testing.assert_close(
            torch.cat([r["y"][step].float() for r in per_rank]), expected["y"][step].float(), **tol
        )
        if case["grad_x"]:
            got = torch.cat([r["gx"][step].float() for r in per_rank])
            torch.testing.assert_close(got, expected["gx"][step].float(), **grad_tol)
        for key in ("gw", "gb"):
            if expected[key][step] is not None:
                local_sum = torch.stack([r[key][step].float() for r in per_rank]).sum(0)
                torch.testing.assert_close(local_sum, expected[key][step].float(), **grad_tol)
    for r in per_rank:
        for name, value in expected["state"].items():
            torch.testing.assert_close(
                r["state"][name].to(value.dtype), value, **tol, msg=lambda m, n=name: f"{n}: {m}"
            )


# ---------------------------------------------------------------- tests


CASES_2 = {
    "bn1d_2d_input": _case((3,), [4, 4]),
    "bn1d_3d_input": _case((3, 5), [3, 3]),
    "bn2d": _case((3, 4, 4), [2, 2]),
    "bn3d": _case((2, 2, 3, 3), [2, 2]),
    "momentum_none": _case((3,), [4, 4], momentum=None, steps=4),
    "no_affine_no_running_stats": _case((3, 4, 4), [2, 2], affine=False, track_running_stats=False),
    "no_bias": _case((3, 2), [3, 3], bias=False),
    "input_without_grad": _case((3, 4, 4), [2, 3]),
}
CASES_2["input_without_grad"]["grad_x"] = False


def test_two_ranks_match_the_concatenated_batch() -> None:
    names = list(CASES_2)
    out = run_distributed(_run_cases, 2, args=([CASES_2[n] for n in names],), timeout=90)
    for i, name in enumerate(names):
        case = CASES_2[name]
        _compare(case, [out[0][i], out[1][i]], _oracle(case))


CASES_3 = {
    "unequal_bn1d": _case((4,), [3, 5, 7]),
    "unequal_bn1d_3d_input": _case((2, 3), [2, 1, 4]),
    "unequal_bn2d": _case((3, 3, 3), [1, 2, 3]),
    "empty_rank": _case((3, 2), [4, 0, 6]),
    # |mean|/std = 500: float32 sum-of-squares would lose the variance; the oracle runs in float64.
    "large_offset": _case((4,), [6, 4, 5], offset=1000.0),
}


def test_three_ranks_with_unequal_and_empty_batches() -> None:
    names = list(CASES_3)
    out = run_distributed(_run_cases, 3, args=([CASES_3[n] for n in names],), timeout=90)
    for i, name in enumerate(names):
        case = CASES_3[name]
        if name == "large_offset":
            # x itself is float32 with spacing 6e-5 near 1000, which bounds what any float32 layer can do.
            _compare(
                case,
                [r[i] for r in out],
                _oracle(case, torch.float64),
                tol={"atol": 3e-4, "rtol": 1e-5},
                grad_tol={"atol": 2e-3, "rtol": 1e-4},
            )
        else:
            _compare(case, [r[i] for r in out], _oracle(case))
    assert out[1][names.index("empty_rank")]["y"][0].shape == (0, 3, 2)


def _count_collectives(fn: Any) -> tuple[Any, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        value = fn()
    return value, sum(1 for e in prof.events() if e.name.startswith("c10d::"))


def _collectives_and_eval(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(SyncBatchNorm(4), torch.nn.Linear(4, 4), SyncBatchNorm(4))
    x = torch.randn(5 + rank, 4, requires_grad=True)
    y, forward_count = _count_collectives(lambda: model(x))
    _, backward_count = _count_collectives(lambda: y.sum().backward())
    result = {"forward": forward_count, "backward": backward_count}
    # Eval on rank 1 only: a collective here would hang (rank 0 never joins) or corrupt the sum below.
    layer = SyncBatchNorm(4)
    layer.load_state_dict(state)
    stateless = SyncBatchNorm(4, track_running_stats=False).eval()
    layer.eval()
    if rank == 1:
        xe = torch.randn(6, 4)
        (ye, ys), eval_count = _count_collectives(lambda: (layer(xe), stateless(xe)))
        reference = torch.nn.SyncBatchNorm(4)  # torch's own layer accepts CPU tensors in eval mode
        reference.load_state_dict(state)
        reference.eval()
        result.update(
            eval=eval_count,
            eval_out=ye,
            torch_eval_out=reference(xe),
            stateless_out=ys,
            local_batch_norm=torch.nn.functional.batch_norm(xe, None, None, training=True),
        )
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    result["after"] = total.item()
    # One value per channel in the whole group: every rank raises the same error after the collective.
    try:
        SyncBatchNorm(4)(torch.randn(1 - rank, 4))
    except ConfigError as exc:
        result["tiny_batch_error"] = str(exc)
    dist.all_reduce(total)
    result["still_in_step"] = total.item()
    return result


def test_one_collective_per_forward_and_backward_and_none_in_eval() -> None:
    state = SyncBatchNorm(4).state_dict()
    state.update(
        running_mean=torch.tensor([0.5, -1.0, 2.0, 0.0]), running_var=torch.tensor([1.0, 4.0, 0.25, 2.0])
    )
    out = run_distributed(_collectives_and_eval, 2, args=(state,), timeout=60)
    for r in out:
        assert (r["forward"], r["backward"], r["after"]) == (2, 2, 3.0), r
    assert out[1]["eval"] == 0
    for rank, r in enumerate(out):
        assert f"[rank {rank}/2] SyncBatchNorm saw 1 value(s) per channel" in r["tiny_batch_error"]
        assert r["still_in_step"] == 6.0
    torch.testing.assert_close(out[1]["eval_out"], out[1]["torch_eval_out"], atol=0, rtol=0)
    # Eval without running statistics: this rank's own batch statistics, like torch.
    torch.testing.assert_close(out[1]["stateless_out"], out[1]["local_batch_norm"], atol=0, rtol=0)


def _world_of_one(x: torch.Tensor) -> dict[str, Any]:
    ours, theirs = SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ya, yb), count = _count_collectives(lambda: (ours(xa), theirs(xb)))
    ya.sum().backward()
    yb.sum().backward()
    return {
        "count": count,
        "pairs": [
            (ya, yb),
            (xa.grad, xb.grad),
            (ours.running_var, theirs.running_var),
            (ours.weight.grad, theirs.weight.grad),
        ],
    }


def test_world_of_one_is_plain_batchnorm() -> None:
    (out,) = run_distributed(_world_of_one, 1, args=(torch.randn(5, 3, 2),), timeout=60)
    assert out["count"] == 0
    for a, b in out["pairs"]:
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _subgroups(pair_cases: list[dict[str, Any]], trio_case: dict[str, Any]) -> dict[str, Any]:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    trio = dist.new_group([0, 1, 2])
    result: dict[str, Any] = {"pair": _rank_run(pair_cases[rank // 2], pairs[rank // 2], rank % 2)}
    if rank < 3:
        result["trio"] = _rank_run(trio_case, trio, rank)
    else:
        layer = SyncBatchNorm(3, process_group=trio)
        try:
            layer(torch.randn(4, 3))
        except ConfigError as exc:
            result["error"] = str(exc)
        layer.eval()
        result["eval_ok"] = layer(torch.randn(4, 3)).shape == (4, 3)
    return result


def test_process_subgroups() -> None:
    pair_cases = [_case((3, 2), [3, 4], seed=1), _case((3, 2), [5, 2], seed=2)]
    trio_case = _case((2, 3, 3), [2, 3, 1], seed=3)
    out = run_distributed(_subgroups, 4, args=(pair_cases, trio_case), timeout=90)
    _compare(pair_cases[0], [out[0]["pair"], out[1]["pair"]], _oracle(pair_cases[0]))
    _compare(pair_cases[1], [out[2]["pair"], out[3]["pair"]], _oracle(pair_cases[1]))
    _compare(trio_case, [out[r]["trio"] for r in range(3)], _oracle(trio_case))
    assert "[rank 3/4]" in out[3]["error"] and "not a member of its process_group" in out[3]["error"]
    assert out[3]["eval_ok"]


def _low_precision(
    case: dict[str, Any], model_state: dict[str, torch.Tensor], xs: torch.Tensor
) -> dict[str, Any]:
    rank = dist.get_rank()
    result = {"bf16": _rank_run(case)}
    model = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)))
    model.load_state_dict(model_state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(xs[rank * 5 : rank * 5 + 5])
    result["autocast_y"] = y.detach()
    result["autocast_state"] = model[1].state_dict()
    return result


def test_bf16_inputs_and_autocast_match_float32() -> None:
    case = _case((3, 4, 4), [3, 5], dtype=torch.bfloat16, steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    xs = torch.randn(10, 6)
    out = run_distributed(_low_precision, 2, args=(case, model.state_dict(), xs), timeout=90)
    assert out[0]["bf16"]["y"][0].dtype == torch.bfloat16 and out[0]["bf16"]["gx"][0].dtype == torch.bfloat16
    expected = _oracle(case, torch.float32)  # float32 on the very same bf16-rounded inputs
    loose = {"atol": 3e-2, "rtol": 2e-2}  # output and input-grad rounding to bf16 (8 bits of mantissa)
    for step in range(2):
        torch.testing.assert_close(
            torch.cat([r["bf16"]["y"][step].float() for r in out]), expected["y"][step], **loose
        )
        torch.testing.assert_close(
            torch.cat([r["bf16"]["gx"][step].float() for r in out]), expected["gx"][step], **loose
        )
    # Running statistics depend on the inputs only, computed in float32 from identical values: tight.
    for r in out:
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(r["bf16"]["state"][name], expected["state"][name], **TOL)
    y = torch.cat([r["autocast_y"] for r in out])
    assert y.dtype == torch.bfloat16
    model.train()
    torch.testing.assert_close(y.float(), model(xs).detach(), atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(
        out[0]["autocast_state"]["running_mean"], model[1].running_mean, atol=1e-2, rtol=1e-2
    )
    torch.testing.assert_close(
        out[1]["autocast_state"]["running_var"], model[1].running_var, atol=1e-2, rtol=1e-2
    )


def _ddp_training(
    engine: str, model_state: dict[str, torch.Tensor], xs: torch.Tensor, ts: torch.Tensor
) -> dict[str, Any]:
    rank = dist.get_rank()
    model = convert_sync_batchnorm(_conv_net())
    model.load_state_dict(model_state)
    wrapper = (
        torch.nn.parallel.DistributedDataParallel if engine == "torch" else lockstep.DistributedDataParallel
    )
    ddp = wrapper(model)  # CPU module, gloo: torch's own DDP would refuse torch.nn.SyncBatchNorm here
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for x, t in zip(xs, ts):
        loss = torch.nn.functional.mse_loss(ddp(x[rank * 4 : rank * 4 + 4]), t[rank * 4 : rank * 4 + 4])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _conv_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 36, 2),
    )


@pytest.mark.parametrize("engine", ["torch", "lockstep"])
def test_with_ddp_matches_single_process_training(engine: str) -> None:
    """Under torch's DDP or lockstep's, with their gradient all-reduces interleaved with ours."""
    model = _conv_net()
    xs, ts = torch.randn(3, 8, 3, 8, 8), torch.randn(3, 8, 2)
    out = run_distributed(_ddp_training, 2, args=(engine, model.state_dict(), xs, ts), timeout=90)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, t in zip(xs, ts):  # mean loss over 8 = DDP's average of two local means over 4
        loss = torch.nn.functional.mse_loss(model(x), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for state in out:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_public_names() -> None:
    assert lockstep.nn.SyncBatchNorm is SyncBatchNorm
    assert lockstep.nn.convert_sync_batchnorm is convert_sync_batchnorm
