"""Mixed precision (issue 4 item 4): autocast, low-precision parameters, reduce dtype, GradScaler agreement.

- bf16 autocast on CPU: the engine's gradients equal torch DDP's under the same autocast.
- bf16 parameters: reduced in fp32 by default (SyncPolicy.reduce_dtype=None), in bf16 when asked;
  checked bit for bit against both arithmetics, on every bucket path (bulk copy, eager copy, solo).
- fp16 autocast with GradScaler: an inf in one rank's gradient reaches every rank through the
  all-reduce, so every rank skips the same step and backs off its scale the same way.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.testing import run_distributed
from lockstep.testing.parity import run_parity
from tests.helpers import assert_close_lists, batch, build, case, params_of, wrap

TIMEOUT = 60


# ---------------------------------------------------------------- bf16 autocast: parity with torch DDP


def _autocast_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16  # autocast is really on
    return F.cross_entropy(out.float(), y)


def test_bf16_autocast_gradients_match_torch_ddp() -> None:
    # bf16 roundings depend on the batch: one process on the concatenated batch is no reference here
    runs = {"mlp": {}, "convbn": {}, "many_small": {"bucket_cap_mb": 0.0005}}
    run_parity(
        {
            name: case(name, 3, ddp_kwargs=kw, loss=_autocast_loss, single_process=False)
            for name, kw in runs.items()
        },
        2,
        timeout=TIMEOUT,
    )


# ---------------------------------------------------------------- bf16 parameters: the reduce dtype

# Registration order puts each parameter on one bucket path (buckets go in reverse order):
# small -> a bulk-copy bucket, eager -> an eager-copy bucket, big -> a solo bucket (4 MiB or more in
# either reduce dtype), tail -> the last bucket (never solo; it carries the status element).
SIZES = {"tail": 64, "big": 1 << 21, "eager": 1 << 15, "small": 1 << 12}
CAPS = {"bucket_cap_mb": 0.05, "first_bucket_mb": 0.005}


class Probe(nn.Module):
    """loss = sum_p (p * x_p).sum(): the gradient of p is exactly x_p, whatever p's dtype."""

    def __init__(self) -> None:
        super().__init__()
        for name, n in SIZES.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)))

    def forward(self, xs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, name) * xs[name]).sum() for name in SIZES)  # type: ignore[return-value]


def probe_grads(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(77 + rank)
    return {name: torch.randn(n, generator=gen).bfloat16() for name, n in SIZES.items()}


def _reduce_dtype_run() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for label, reduce_dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        module = Probe()
        handle = lockstep.replicate(module, policy=lockstep.SyncPolicy(**CAPS, reduce_dtype=reduce_dtype))
        module(probe_grads(rank)).backward()
        stats = handle.stats()
        out[label] = {
            "grads": {name: getattr(module, name).grad.clone() for name in SIZES},
            "dtypes": stats.extras["bucket_dtypes"],
            "sizes": stats.bucket_sizes_bytes,
            "params_per_bucket": stats.bucket_num_params,
        }
        handle.remove()
    module = Probe()
    ddp = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.1)
    ddp(probe_grads(rank)).backward()
    out["torch"] = {name: getattr(module, name).grad.clone() for name in SIZES}
    return out


def _possible_sums(terms: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Sums of the terms in every order, each addition rounded to `dtype` (how gloo adds)."""
    sums = []
    for order in itertools.permutations(terms):
        acc = order[0].to(dtype)
        for t in order[1:]:
            acc = acc + t.to(dtype)
        sums.append(acc)
    return sums


def _matches_one_of(got: torch.Tensor, candidates: list[torch.Tensor]) -> torch.Tensor:
    ok = torch.zeros_like(got, dtype=torch.bool)
    for c in candidates:
        ok |= got == c.to(got.dtype)
    return ok


def test_bf16_parameters_reduce_in_fp32_by_default_and_in_bf16_when_asked() -> None:
    world = 3
    out = run_distributed(_reduce_dtype_run, world, timeout=TIMEOUT)
    inv = 1.0 / world
    for rank_out in out:
        for label in ("fp32", "bf16"):
            assert rank_out[label]["params_per_bucket"] == [1, 1, 1, 1]  # one parameter per path
        assert (
            rank_out["fp32"]["dtypes"] == ["float32"] * 4 and rank_out["bf16"]["dtypes"] == ["bfloat16"] * 4
        )
        numels = [SIZES[n] for n in ("small", "eager", "big", "tail")]
        assert rank_out["fp32"]["sizes"] == [4 * n for n in numels]
        assert rank_out["bf16"]["sizes"] == [2 * n for n in numels]
    differs = {}
    for name in SIZES:
        xs = [probe_grads(r)[name] for r in range(world)]
        fp32_got, bf16_got = out[0]["fp32"]["grads"][name], out[0]["bf16"]["grads"][name]
        assert fp32_got.dtype == bf16_got.dtype == torch.bfloat16
        for r in range(1, world):  # every rank holds the same result
            assert torch.equal(out[r]["fp32"]["grads"][name], fp32_got)
            assert torch.equal(out[r]["bf16"]["grads"][name], bf16_got)
        # fp32: each grad widened exactly, scaled and summed in fp32, rounded to bf16 once at the end
        fp32_sums = [s.bfloat16() for s in _possible_sums([x.float() * inv for x in xs], torch.float32)]
        assert bool(_matches_one_of(fp32_got, fp32_sums).all()), f"{name}: not the fp32 sum of the bf16 grads"
        # bf16: scaled in bf16, each addition rounded to bf16
        bf16_sums = _possible_sums([x * inv for x in xs], torch.bfloat16)
        assert bool(_matches_one_of(bf16_got, bf16_sums).all()), f"{name}: not the bf16 sum"
        # ... and torch's DDP, which reduces bf16 parameters in bf16, lands on the same arithmetic
        assert bool(_matches_one_of(out[0]["torch"][name], bf16_sums).all()), f"{name}: torch"
        exact = sum(x.double() for x in xs) / world
        err32 = (fp32_got.double() - exact).abs().mean().item()
        err16 = (bf16_got.double() - exact).abs().mean().item()
        differs[name] = (fp32_got != bf16_got).float().mean().item()
        assert err32 < err16, (
            f"{name}: fp32 reduction should be closer to the exact mean ({err32} vs {err16})"
        )
    assert all(frac > 0.05 for frac in differs.values()), differs  # the two arithmetics really differ


# ---------------------------------------------------------------- fp16 + GradScaler: one verdict


INF_STEP, INF_RANK = 1, 1


def _scaler_run(kind: str, local_at_inf_step: bool = False) -> dict[str, Any]:
    """3 steps of fp16 autocast + GradScaler; at INF_STEP rank INF_RANK's fc1.weight grad gets one inf."""
    rank = dist.get_rank()
    module = build("mlp", seed=rank)
    model, handle = wrap(kind, module)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales, skipped = [], []
    for step in range(3):
        x, y = batch(rank, step)
        hook = None
        if step == INF_STEP and rank == INF_RANK:
            hook = module.fc1.weight.register_hook(_one_inf)
        # the control: the inf step without the engine's all-reduce (only the owning rank sees it)
        local = local_at_inf_step and step == INF_STEP
        with handle.no_sync() if local else _nothing():
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            assert out.dtype == torch.float16
            scaler.scale(F.cross_entropy(out.float(), y)).backward()
        if hook is not None:
            hook.remove()
        before = params_of(module)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, params_of(module))))
        scales.append(scaler.get_scale())
    return {"scales": scales, "skipped": skipped, "params": params_of(module)}


def _one_inf(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[3] = float("inf")
    return grad


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _scaler_all() -> dict[str, Any]:
    return {kind: _scaler_run(kind) for kind in ("ours", "replicate", "torch")} | {
        "control": _scaler_run("ours", local_at_inf_step=True)
    }


def test_fp16_grad_scaler_every_rank_skips_the_step_with_an_inf_on_one_rank() -> None:
    out = run_distributed(_scaler_all, 2, timeout=TIMEOUT)
    for kind in ("ours", "replicate", "torch"):
        for rank in range(2):
            got = out[rank][kind]
            assert got["skipped"] == [False, True, False], (kind, rank, got["skipped"])
            assert got["scales"] == [1024.0, 512.0, 512.0], (kind, rank, got["scales"])
            for a, b in zip(got["params"], out[0][kind]["params"]):
                assert torch.equal(a, b), f"{kind}: rank {rank} params differ from rank 0's"
        if kind != "torch":
            assert_close_lists(
                out[0][kind]["params"], out[0]["torch"]["params"], atol=1e-6, rtol=1e-5, what=kind
            )
    # the control shows what the check catches: without the all-reduce only the rank with the inf skips
    assert out[INF_RANK]["control"]["skipped"][INF_STEP] and not out[0]["control"]["skipped"][INF_STEP]
    assert out[0]["control"]["scales"][INF_STEP] != out[INF_RANK]["control"]["scales"][INF_STEP]
