"""GPU tier: CUDA/NCCL at world size 1, gloo with CUDA tensors, mixed precision, a cpu+cuda replica.

Skipped where torch sees no CUDA device; run on a GPU machine with `pytest tests/gpu`.
LOCKSTEP_GPU_TIER_ON_CPU=1 runs it on the CPU (device "cpu", gloo in place of nccl) to check the tests'
own logic; the cpu+cuda replica stays skipped there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.testing import run_distributed
from tests.helpers import GPU_BACKEND, GPU_MARKS, GPU_TIER_ON_CPU, gpu_device, needs_cuda

pytestmark = GPU_MARKS


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)


def _parity_with_torch(backend: str, dtype: str) -> float:
    rank = torch.distributed.get_rank()
    device = gpu_device() if GPU_TIER_ON_CPU else torch.device("cuda", rank % torch.cuda.device_count())
    ids = [device.index] if device.type == "cuda" else None
    ours = lockstep.DistributedDataParallel(_model(device), device_ids=ids)
    ref = torch.nn.parallel.DistributedDataParallel(_model(device), device_ids=ids)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=gen).to(device), torch.randn(16, 8, generator=gen).to(device)
    autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype)
    for model in (ours, ref):
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
    return max(float((a.grad - b.grad).abs().max()) for a, b in zip(ours.parameters(), ref.parameters()))


def test_nccl_world_of_one_matches_torch() -> None:
    worst = run_distributed(
        _parity_with_torch, 1, args=(GPU_BACKEND, "fp32"), backend=GPU_BACKEND, timeout=180
    )
    assert worst[0] < 1e-6


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_mixed_precision_on_cuda_matches_torch(dtype: str) -> None:
    worst = run_distributed(
        _parity_with_torch, 1, args=(GPU_BACKEND, dtype), backend=GPU_BACKEND, timeout=180
    )
    assert worst[0] < 1e-3


def test_gloo_with_cuda_tensors_two_ranks() -> None:
    # Both ranks may share one GPU: gloo moves CUDA tensors through host memory.
    assert (
        max(run_distributed(_parity_with_torch, 2, args=("gloo", "fp32"), backend="gloo", timeout=180)) < 1e-6
    )


class _Split(nn.Module):
    """The model-parallel tutorial's split, with its first half on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1, self.net2 = nn.Linear(10, 10), nn.Linear(10, 5).cuda()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(x)).cuda())


def _split_replica() -> dict[str, Any]:
    refusals = []
    for wrapper in (lockstep.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        try:
            wrapper(_Split())
        except ValueError as error:  # torch's type for a module on two device types
            refusals.append(str(error).split(",")[0])
    model, oracle = _Split(), _Split()
    lockstep.replicate(model)  # lockstep's own API takes a module across device types
    rank = torch.distributed.get_rank()
    xs = torch.randn(2, 20, 10, generator=torch.Generator().manual_seed(3))
    model(xs[rank]).square().mean().backward()
    # The oracle: one process, the mean of both ranks' losses.
    (sum(oracle(x).square().mean() for x in xs) / 2).backward()
    worst = max(
        float((p.grad.cpu() - q.grad.cpu()).abs().max())
        for p, q in zip(model.parameters(), oracle.parameters())
    )
    devices = sorted({p.grad.device.type for p in model.parameters()})
    return {"refusals": refusals, "worst": worst, "devices": devices}


@needs_cuda
def test_replica_split_across_cpu_and_cuda() -> None:
    for result in run_distributed(_split_replica, 2, backend="gloo", timeout=180):
        # DistributedDataParallel refuses it as torch's does (same type, same message) ...
        assert len(result["refusals"]) == 2 and result["refusals"][0] == result["refusals"][1], result
        # ... and replicate() averages the gradients of both devices' parameters.
        assert result["devices"] == ["cpu", "cuda"]
        assert result["worst"] < 1e-6, result


def _fp16_scaler_agrees() -> list[float]:
    rank = torch.distributed.get_rank()
    device = gpu_device()
    model = lockstep.DistributedDataParallel(_model(device))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for step in range(4):
        x = torch.randn(8, 32, device=device) * (
            1e4 if (step == 1 and rank == 1) else 1.0
        )  # overflow on rank 1 only
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_fp16_grad_scaler_skips_the_same_steps_on_every_rank() -> None:
    scales = run_distributed(_fp16_scaler_agrees, 2, backend="gloo", timeout=180)
    assert scales[0] == scales[1]
