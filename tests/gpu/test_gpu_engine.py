"""GPU tier, engine and trainer: what only a CUDA device can show.

- NCCL rejects CPU tensors: find_unused_parameters, static_graph and comm hooks must keep every
  tensor they all-reduce on the replica's device (issue 11 found CPU bitmaps by reading).
- Deterministic mode on CUDA: the same bits at world size 1 (NCCL) and 2 (gloo, CUDA tensors), with
  dropout drawing from the CUDA generator.
- lockstep.nn.SyncBatchNorm on CUDA tensors against BatchNorm on the concatenated batch.
- lockstep.fit on CUDA in fp32, bf16 and fp16: replicas identical.

Skipped where torch sees no CUDA device; run on a GPU machine with `pytest tests/gpu`. Two ranks share
the one GPU through gloo (NCCL refuses two ranks on one device). LOCKSTEP_GPU_TIER_ON_CPU=1 runs it on the
CPU (device "cpu", gloo in place of nccl) to check the tests' own logic.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.jobs import catalog
from lockstep.testing import run_distributed
from tests.helpers import GPU_BACKEND, GPU_DEVICE, GPU_MARKS, gpu_device, needs_cuda

pytestmark = GPU_MARKS
TIMEOUT = 240


class Branchy(nn.Module):
    """A used trunk and a branch that only some steps use: what find_unused_parameters is for."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(32, 64)
        self.used = nn.Linear(64, 8)
        self.sometimes = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.used(h) + (self.sometimes(h) if use_branch else 0)


def _grads_after_steps(wrapper: Any, kwargs: dict[str, Any], hook: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    device = gpu_device()
    model = wrapper(Branchy().to(device), device_ids=[0] if device.type == "cuda" else None, **kwargs)
    if hook is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, getattr(default_hooks, hook))
    gen = torch.Generator().manual_seed(1)
    grads = []
    for step in range(4):
        x = torch.randn(16, 32, generator=gen).to(device)
        model(
            x, use_branch=step % 2 == 0 or not kwargs.get("find_unused_parameters", False)
        ).square().mean().backward()
        grads += [
            p.grad.detach().clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()
        ]
        model.zero_grad(set_to_none=True)
    return grads


def _nccl_engine_options(kwargs: dict[str, Any], hook: str | None) -> float:
    ours = _grads_after_steps(lockstep.DistributedDataParallel, kwargs, hook)
    theirs = _grads_after_steps(torch.nn.parallel.DistributedDataParallel, kwargs, hook)
    assert [g.shape for g in ours] == [g.shape for g in theirs]
    assert all(g.device.type == GPU_DEVICE for g in ours if g.numel())
    return max((float((a - b).abs().max()) for a, b in zip(ours, theirs) if a.numel()), default=0.0)


@pytest.mark.parametrize(
    ("kwargs", "hook"),
    [
        ({"find_unused_parameters": True}, None),
        ({"static_graph": True}, None),
        ({}, "fp16_compress_hook"),
        pytest.param({}, "bf16_compress_hook", marks=needs_cuda),  # torch's DDP wants CUDA and NCCL for it
        ({"find_unused_parameters": True}, "allreduce_hook"),
    ],
    ids=["find_unused", "static_graph", "fp16_hook", "bf16_hook", "find_unused+hook"],
)
def test_nccl_engine_options_keep_tensors_on_the_device_and_match_torch(
    kwargs: dict[str, Any], hook: str | None
) -> None:
    worst = run_distributed(
        _nccl_engine_options, 1, args=(kwargs, hook), backend=GPU_BACKEND, timeout=TIMEOUT
    )[0]
    assert worst == 0.0


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(24, 96), nn.ReLU(), nn.Dropout(0.25), nn.Linear(96, 96), nn.GELU()
        )
        self.head = nn.Linear(96, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _deterministic_on_cuda() -> str:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = gpu_device()
    torch.manual_seed(0)
    model = DropNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = lockstep.replicate(model, policy=lockstep.SyncPolicy(deterministic=True))
    gen = torch.Generator().manual_seed(5)
    steps, k, micro = 4, 6, 4
    data = torch.randn(steps * k * micro, 24, generator=gen).to(device)
    labels = torch.randint(0, 6, (steps * k * micro,), generator=gen).to(device)

    def micro_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()

    for step in range(steps):
        mine = {}
        for index in handle.owned_micro_batches(k):
            start = (step * k + index) * micro
            mine[index] = (data[start : start + micro], labels[start : start + micro])
        handle.accumulate(micro_step, mine, num_micro_batches=k, step=step, seed=3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_deterministic_mode_on_cuda_gives_the_same_bits_at_world_sizes_1_and_2() -> None:
    one = run_distributed(_deterministic_on_cuda, 1, backend=GPU_BACKEND, timeout=TIMEOUT)
    two = run_distributed(_deterministic_on_cuda, 2, backend="gloo", timeout=TIMEOUT)
    assert len(set(two)) == 1
    assert one[0] == two[0]


def _syncbn_on_cuda() -> dict[str, float]:
    from lockstep.nn import SyncBatchNorm

    rank, world = dist.get_rank(), dist.get_world_size()
    device = gpu_device()
    gen = torch.Generator().manual_seed(11)
    full = (torch.randn(6 * world, 5, 7, generator=gen) * 2 + 0.5).to(device)
    upstream = torch.randn(full.shape, generator=gen).to(device)
    ours = SyncBatchNorm(5).to(device)
    reference = nn.BatchNorm1d(5).to(device).double()
    mine = full[rank * 6 : (rank + 1) * 6].clone().requires_grad_(True)
    ours(mine).backward(upstream[rank * 6 : (rank + 1) * 6])
    whole = full.double().clone().requires_grad_(True)
    reference(whole).backward(upstream.double())
    weight_grad = ours.weight.grad.clone()
    dist.all_reduce(weight_grad)
    return {
        "input_grad": float((mine.grad.double() - whole.grad[rank * 6 : (rank + 1) * 6]).abs().max()),
        "weight_grad": float((weight_grad.double() - reference.weight.grad).abs().max()),
        "running_mean": float((ours.running_mean.double() - reference.running_mean).abs().max()),
        "running_var": float((ours.running_var.double() - reference.running_var).abs().max()),
    }


def test_syncbatchnorm_on_cuda_tensors_matches_the_concatenated_batch() -> None:
    for result in run_distributed(_syncbn_on_cuda, 2, backend="gloo", timeout=TIMEOUT):
        assert max(result.values()) < 1e-4, result


def _fit_toy_on_cuda(run_dir: str, precision: str) -> dict[str, Any]:
    config_cls, _ = catalog.job("toy")
    config = config_cls(
        run_dir=run_dir, progress="none", device=GPU_DEVICE, precision=precision, num_samples=256, epochs=2
    )
    built = catalog.build("toy", config)
    result = lockstep.fit(built.model, built.train_data, loss_fn=built.loss_fn, config=config)
    assert next(built.model.parameters()).device.type == GPU_DEVICE
    return {"sha": result.summary["params_sha256"], "loss": result.summary["final_train"]["train_loss"]}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fit_on_cuda_keeps_replicas_identical(precision: str, tmp_path: Any) -> None:
    results = run_distributed(
        _fit_toy_on_cuda, 2, args=(str(tmp_path), precision), backend="gloo", timeout=TIMEOUT
    )
    assert results[0]["sha"] == results[1]["sha"]
    assert math.isfinite(results[0]["loss"]) and results[0]["loss"] == results[1]["loss"]
