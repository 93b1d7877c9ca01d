"""runtime/memory.py: the model state's bytes, exact, each storage once, local shards only; the peak."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lockstep.runtime.memory import (
    PROCESS_MAX_RSS,
    MemoryMeter,
    ModelStateBytes,
    model_state_bytes,
    peak_bytes,
    tensor_bytes,
)
from lockstep.testing import run_distributed

F32 = 4


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))  # 12 + 3 + 6 + 2 = 23 elements


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, width: int = 4) -> None:
    model(torch.randn(5, width)).square().sum().backward()
    optimizer.step()


def test_plain_model_with_adamw_after_one_step_counts_exact_bytes() -> None:
    model = _two_layers()
    optimizer = torch.optim.AdamW(model.parameters())
    _one_step(model, optimizer)
    params = 23 * F32
    optimizer_bytes = 2 * params + 4 * F32  # exp_avg, exp_avg_sq, and a float32 `step` per parameter
    assert model_state_bytes(model, optimizer) == ModelStateBytes(
        params=params, grads=params, optimizer=optimizer_bytes, total=2 * params + optimizer_bytes
    )
    optimizer.zero_grad(set_to_none=True)
    assert model_state_bytes(model, optimizer).grads == 0


def test_tied_parameters_count_once() -> None:
    class TiedHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 6)  # 60 elements
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight  # the same Parameter twice

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x))

    model = TiedHead()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    counted = model_state_bytes(model, optimizer)
    assert (counted.params, counted.grads, counted.optimizer) == (60 * F32, 60 * F32, 2 * 60 * F32 + F32)

    # Two Parameter objects over one storage (aliases the module cannot see as one) count once too.
    base = torch.zeros(8)
    aliased = nn.Module()
    aliased.a, aliased.b = nn.Parameter(base), nn.Parameter(base)
    assert len(list(aliased.parameters())) == 2
    assert model_state_bytes(aliased, torch.optim.SGD(aliased.parameters(), lr=0.1)).params == 8 * F32


def test_views_count_what_they_cover() -> None:
    bucket = torch.zeros(100)
    assert tensor_bytes([bucket[10:30], bucket[20:40], bucket[90:]]) == (30 + 10) * F32  # union of ranges
    assert tensor_bytes([bucket, bucket[5:9]]) == 100 * F32
    # Gradients that are views of one bucket (gradient_as_bucket_view): the bucket's bytes they cover.
    model = _two_layers()
    flat, offset = torch.zeros(23 + 9), 0  # 9 elements of the bucket are not gradients
    for p in model.parameters():
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    assert model_state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1)).grads == 23 * F32
    strided = torch.zeros(4, 6)[:, :2]  # non-contiguous: the span from its first to its last element
    assert tensor_bytes([strided]) == (3 * 6 + 2) * F32


def test_meter_keeps_its_first_sample_and_counts_at_the_end_without_one() -> None:
    model = _two_layers()
    optimizer = torch.optim.AdamW(model.parameters())
    meter = MemoryMeter()
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    meter.sample(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    meter.sample(model, optimizer)  # later calls keep the first
    memory = meter.summary(model, optimizer)
    assert memory["grads_bytes"] == 23 * F32 and memory["sampled_at"] == "step"
    assert memory["model_state_bytes"] == memory["params_bytes"] * 2 + memory["optimizer_bytes"]
    assert memory["peak_source"] == PROCESS_MAX_RSS and memory["peak_bytes"] > 10 * 2**20  # a torch process

    unsampled = MemoryMeter().summary(model, optimizer)  # a run that took no step: no gradients then
    assert unsampled["sampled_at"] == "end" and unsampled["grads_bytes"] == 0
    assert unsampled["optimizer_bytes"] == memory["optimizer_bytes"]


def test_peak_on_the_cpu_is_the_process_max_rss() -> None:
    before, source = peak_bytes(torch.device("cpu"))
    held = torch.ones(64 * 2**20 // F32)  # 64 MiB, touched
    after, _ = peak_bytes(torch.device("cpu"))
    assert source == PROCESS_MAX_RSS and after >= max(before, held.numel() * F32)


def _sharded_counts() -> dict[str, Any]:
    """On each of 2 ranks: an FSDP-sharded model (DTensor parameters) and a ZeRO-1 ShardedOptimizer, each
    counted after one step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lockstep.engine.optim.shard_optimizer import ShardedOptimizer

    torch.manual_seed(0)
    fsdp = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # 212 elements; dim 0 halves: 106 a rank
    fully_shard(fsdp, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    fsdp_optimizer = torch.optim.AdamW(fsdp.parameters())
    _one_step(fsdp, fsdp_optimizer, width=8)
    assert all(isinstance(p, DTensor) for p in fsdp.parameters())

    replicated = _two_layers()
    sharded = ShardedOptimizer(torch.optim.AdamW(replicated.parameters()))
    replicated(torch.randn(5, 4)).sum().backward()
    for p in replicated.parameters():  # the engine's all-reduce would have averaged them: same on each rank
        dist.all_reduce(p.grad)
    sharded.step()
    return {
        "fsdp": model_state_bytes(fsdp, fsdp_optimizer),
        "global_params": sum(p.numel() for p in fsdp.parameters()) * F32,
        "zero1": model_state_bytes(replicated, sharded),
    }


def test_dtensor_and_sharded_optimizer_count_this_ranks_local_bytes() -> None:
    ranks = run_distributed(_sharded_counts, 2, timeout=120)
    local = 106 * F32
    for counts in ranks:
        assert counts["global_params"] == 2 * local  # the global size, which the meter must not count
        assert counts["fsdp"] == ModelStateBytes(
            params=local, grads=local, optimizer=2 * local + 4 * F32, total=4 * local + 4 * F32
        )
    # ZeRO-1: each rank holds its units' state only; the shares add up to the unsharded optimizer's.
    shares = [counts["zero1"].optimizer for counts in ranks]
    assert sum(shares) == 2 * 23 * F32 + 4 * F32 and all(0 < share < sum(shares) for share in shares)
    assert all(counts["zero1"].params == counts["zero1"].grads == 23 * F32 for counts in ranks)
