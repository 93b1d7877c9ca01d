"""GPU tier: CUDA/NCCL at world size 1, gloo with CUDA tensors, mixed precision, a cpu+cuda replica.

Skipped where torch sees no CUDA device; run on a GPU machine with `pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lockstep
from lockstep.testing import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)


def _parity_with_torch(backend: str, dtype: str) -> float:
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    ours = lockstep.DistributedDataParallel(_model(device), device_ids=[device.index])
    ref = torch.nn.parallel.DistributedDataParallel(_model(device), device_ids=[device.index])
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=gen).to(device), torch.randn(16, 8, generator=gen).to(device)
    autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype)
    for model in (ours, ref):
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
    return max(float((a.grad - b.grad).abs().max()) for a, b in zip(ours.parameters(), ref.parameters()))


def test_nccl_world_of_one_matches_torch() -> None:
    assert (
        run_distributed(_parity_with_torch, 1, args=("nccl", "fp32"), backend="nccl", timeout=180)[0] < 1e-6
    )


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_mixed_precision_on_cuda_matches_torch(dtype: str) -> None:
    assert run_distributed(_parity_with_torch, 1, args=("nccl", dtype), backend="nccl", timeout=180)[0] < 1e-3


def test_gloo_with_cuda_tensors_two_ranks() -> None:
    # Both ranks may share one GPU: gloo moves CUDA tensors through host memory.
    assert (
        max(run_distributed(_parity_with_torch, 2, args=("gloo", "fp32"), backend="gloo", timeout=180)) < 1e-6
    )


def _split_replica() -> list[float]:
    torch.manual_seed(0)
    net1, net2 = nn.Linear(10, 10), nn.Linear(10, 5).cuda()

    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net1, self.net2 = net1, net2

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net2(torch.relu(self.net1(x)).cuda())

    model = lockstep.DistributedDataParallel(Split())
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    loss = model(torch.randn(20, 10, generator=gen)).square().mean()
    loss.backward()
    return [float(p.grad.double().sum()) for p in model.parameters()]


def test_replica_split_across_cpu_and_cuda() -> None:
    grads = run_distributed(_split_replica, 2, backend="gloo", timeout=180)
    assert grads[0] == pytest.approx(grads[1], abs=1e-6)


def _fp16_scaler_agrees() -> list[float]:
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", 0)
    model = lockstep.DistributedDataParallel(_model(device))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for step in range(4):
        x = torch.randn(8, 32, device=device) * (
            1e4 if (step == 1 and rank == 1) else 1.0
        )  # overflow on rank 1 only
        with torch.autocast("cuda", dtype=torch.float16):
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
