"""stats() (issue 3 item 10): bucket layout, per-step timings, overlap and bytes, public."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.testing import run_distributed
from tests.helpers import batch, build


def _stats() -> dict:
    module = build("many_small", 0)
    handle = lockstep.replicate(module, policy=lockstep.SyncPolicy(bucket_cap_mb=0.0005))
    before = handle.stats()
    for step in range(3):
        x, y = batch(dist.get_rank(), step)
        F.cross_entropy(module(x), y).backward()
    return {
        "before": before.as_dict(),
        "after": handle.stats().as_dict(),
        "param_bytes": sum(p.numel() * 4 for p in module.parameters()),
    }


def test_stats_report_layout_timings_and_bytes() -> None:
    for out in run_distributed(_stats, 2, timeout=60):
        before, after = out["before"], out["after"]
        assert before["synced_steps"] == 0 and before["last"] is None and not before["buckets_rebuilt"]
        assert after["synced_steps"] == 3 and after["buckets_rebuilt"]
        assert after["num_buckets"] == len(after["bucket_sizes_bytes"]) > 2
        assert sum(after["bucket_sizes_bytes"]) == out["param_bytes"] == after["last"]["bytes_communicated"]
        assert sum(after["bucket_num_params"]) == after["num_parameters"] == 28
        last = after["last"]
        assert last["forward_ms"] > 0 and last["backward_ms"] > 0 and last["comm_ms"] > 0
        assert 0 <= last["comm_hidden_ms"] <= last["comm_ms"] and 0 <= last["overlap"] <= 1
        assert after["mean"]["step"] == 3


class _Reversed(nn.Module):
    """Uses its layers in the reverse of registration order: gradients get ready in registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _rebuild(name: str) -> dict:
    module = build("many_small", 0) if name == "many_small" else _Reversed()
    handle = lockstep.replicate(module, policy=lockstep.SyncPolicy(bucket_cap_mb=0.0005))
    reducer = handle._replica.reducer
    old = list(reducer.buckets)  # held: an id() of a freed bucket may be reused by a new one
    before = [(id(b), b.indices, b.buffer.data_ptr()) for b in old]
    for step in range(2):
        x = batch(dist.get_rank(), step)[0]
        module(x).square().mean().backward()
    after = [(id(b), b.indices, b.buffer.data_ptr()) for b in reducer.buckets]
    return {"before": before, "after": after, "rebuilt": handle.stats().as_dict()["buckets_rebuilt"]}


def test_rebuild_keeps_the_buckets_when_the_ready_order_gives_the_same_layout() -> None:
    for out in run_distributed(_rebuild, 2, args=("many_small",), timeout=60):
        assert out["rebuilt"] and len(out["before"]) > 2
        assert out["after"] == out["before"]  # same objects, parameters and memory: nothing reallocated
    for out in run_distributed(_rebuild, 2, args=("reversed",), timeout=60):
        assert out["rebuilt"]
        assert [ix for _, ix, _ in out["after"]] != [ix for _, ix, _ in out["before"]]
        assert not {i for i, _, _ in out["after"]} & {i for i, _, _ in out["before"]}
