"""GPU tier, the engine's features that never ran on CUDA (issue 38): each on CUDA tensors, with the bits
its CPU tests promise.

- The overlapped optimizer step (the optimizer steps each bucket during backward): the plain step's bits.
- The sharded optimizer, plain and overlapped (the owners' broadcasts of the updated shards, a 1 MiB
  weight in place, the rest packed or cut in pieces): the unsharded run's parameters and full state.

Each at NCCL world 1 (NCCL takes one rank per GPU) and with gloo at world 2 (both ranks share the one GPU;
gloo moves CUDA tensors through host memory). Rank functions hand back CPU copies: a CUDA tensor returned
to the parent would travel by CUDA IPC from a process that exits. The bucket tuner and torch.compile are
test_gpu_tuning_compile.py, the periodic sync modes test_gpu_sync.py.

Where there is no GPU, LOCKSTEP_GPU_TIER_ON_CPU=1 runs this module on the CPU, to check the tests' own
logic before a GPU session: device "cpu", gloo in place of nccl:
`LOCKSTEP_GPU_TIER_ON_CPU=1 OMP_NUM_THREADS=1 pytest tests/gpu/test_gpu_features.py`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import lockstep
import lockstep.hooks
from lockstep.testing import run_distributed
from tests.helpers import GPU_BACKEND, GPU_MARKS, gpu_device, small_batch

pytestmark = GPU_MARKS
TIMEOUT = 240
STEPS = 3
TINY_BUCKETS = {"bucket_cap_mb": 1e-4, "first_bucket_mb": 1e-4}  # about one parameter per bucket
# NCCL at world 1; gloo with CUDA tensors at world 2 (the only way two ranks share one GPU)
WORLDS = pytest.mark.parametrize(
    ("backend", "world"), [(GPU_BACKEND, 1), ("gloo", 2)], ids=["nccl1", "gloo2"]
)
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),  # foreach on CUDA by default
}


class Net(nn.Module):
    """inp -> mid -> out; width 512 makes `mid` a 1 MiB weight (the sharded optimizer's in-place broadcast)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(8, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _replicate(net: nn.Module) -> lockstep.ReplicaHandle:
    """replicate(net) with about one parameter per bucket. Alone (NCCL's world 1) the engine launches no
    collective; a communication hook then sends every bucket through NCCL all the same."""
    handle = lockstep.replicate(net, policy=lockstep.SyncPolicy(**TINY_BUCKETS))
    if dist.get_world_size() == 1:
        handle.register_comm_hook(None, lockstep.hooks.allreduce_hook)
    return handle


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = small_batch(dist.get_rank(), step)
    return x.to(device), y.to(device)


def _bits(net: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """CPU copies of the parameters and the (full) optimizer state, and the devices they lived on (a
    sharded optimizer's consolidated state holds the other ranks' shares where the broadcast left them: on
    the CPU under gloo; its own share is checked on the device)."""
    flat = [
        (f"{i}.{k}", torch.as_tensor(v))
        for i, entry in sorted(state["state"].items())
        for k, v in entry.items()
    ]
    return {
        "params": [p.detach().cpu().clone() for p in net.parameters()],
        "state": [(key, t.cpu().clone()) for key, t in flat],
        "groups": state["param_groups"],
        "devices": sorted({p.device.type for p in net.parameters()}),
        "state devices": sorted({t.device.type for _, t in flat if t.dim() > 0}),  # not Adam's step count
    }


def _assert_same_bits(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    for i, (x, y) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert torch.equal(x, y), f"{what}: parameter {i} differs by {(x - y).abs().max()}"
    assert [k for k, _ in a["state"]] == [k for k, _ in b["state"]], f"{what}: state entries differ"
    for (key, x), (_, y) in zip(a["state"], b["state"]):
        assert torch.equal(x, y), f"{what}: optimizer state {key} differs"
    assert a["groups"] == b["groups"], f"{what}: param_groups differ"


def _on_device(*results: dict[str, Any], state: bool = True) -> None:
    """The parameters (and the optimizer state: `state`) on the tier's device."""
    want = [gpu_device().type]
    for out in results:
        assert out["devices"] == want, f"parameters on {out['devices']}, not {want}"
        assert not state or out["state devices"] == want, f"optimizer state on {out['state devices']}"


# ---------------------------------------------------------------- the overlapped optimizer step


def _overlapped(name: str) -> dict[str, Any]:
    """Two replicas on the same data: one stepped after backward, one by the engine bucket by bucket."""
    device = gpu_device()
    plain_net, net = Net().to(device), Net().to(device)
    _replicate(plain_net)
    handle = _replicate(net)
    plain, inner = OPTIMIZERS[name](plain_net.parameters()), OPTIMIZERS[name](net.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overlapped = handle.overlap_optimizer(inner)
        for step in range(STEPS):
            x, y = _batch(step, device)
            for model, opt in ((plain_net, plain), (net, overlapped)):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
    return {
        "plain": _bits(plain_net, plain.state_dict()),
        "overlapped": _bits(net, inner.state_dict()),
        "stepped": overlapped.buckets_stepped_in_backward + overlapped.buckets_stepped_at_finalize,
        "num_buckets": handle.stats().num_buckets,
        "said": [str(w.message) for w in caught if "overlap_optimizer" in str(w.message)],
    }


def _overlapped_each() -> dict[str, dict[str, Any]]:
    return {name: _overlapped(name) for name in sorted(OPTIMIZERS)}  # one start of the ranks for all


@WORLDS
def test_the_overlapped_step_is_the_plain_steps_bits_on_cuda(backend: str, world: int) -> None:
    results = run_distributed(_overlapped_each, world, backend=backend, timeout=TIMEOUT)
    for name in sorted(OPTIMIZERS):
        for rank, out in enumerate(result[name] for result in results):
            what = f"{name} {backend} rank {rank}/{world}"
            _assert_same_bits(out["plain"], out["overlapped"], what)
            _on_device(out["plain"], out["overlapped"])
            assert out["said"] == [], f"{what}: fell back: {out['said']}"
            assert out["num_buckets"] >= 3 and out["stepped"] == STEPS * out["num_buckets"], (what, out)
            _assert_same_bits(out["overlapped"], results[0][name]["overlapped"], f"{what} against rank 0")


# ---------------------------------------------------------------- the sharded optimizer, plain and overlapped


def _sharded_runs() -> dict[str, Any]:
    """The unsharded run, the sharded one (the 1 MiB weight broadcast whole, in place; the small ones
    packed) and the overlapped sharded one (pieces of 50,000 values: the weight in 6, all packed)."""
    device, rank = gpu_device(), dist.get_rank()
    out: dict[str, Any] = {}
    for kind in ("plain", "sharded", "overlapped"):
        net = Net(width=512).to(device)
        handle = _replicate(net)
        inner = OPTIMIZERS["adamw"](net.parameters())
        stepped: Any = inner
        share: Any = None  # the ShardedOptimizer
        if kind == "sharded":
            stepped = share = handle.shard_optimizer(inner)
        elif kind == "overlapped":
            share = handle.shard_optimizer(inner, piece_numel=50_000)
            stepped = handle.overlap_optimizer(share)
        for step in range(STEPS):
            x, y = _batch(step, device)
            stepped.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            stepped.step()
        extras = handle.stats().extras
        if share is not None:
            out[f"{kind} share"] = sum(t.numel() for s in share.state.values() for t in s.values() if t.dim())
            out[f"{kind} share devices"] = sorted(
                {t.device.type for s in share.state.values() for t in s.values() if t.dim()}
            )
            stepped.consolidate_state_dict(to=None)
        out[kind] = _bits(net, stepped.state_dict())
        out[f"{kind} broadcasts in backward"] = extras.get("optimizer_broadcasts_launched_in_backward", 0)
        handle.remove()
    out["rank"] = rank
    return out


@WORLDS
def test_sharded_steps_plain_and_overlapped_give_the_unsharded_bits_on_cuda(backend: str, world: int) -> None:
    results = run_distributed(_sharded_runs, world, backend=backend, timeout=TIMEOUT)
    plain_numel = sum(t.numel() for key, t in results[0]["plain"]["state"] if t.dim())
    for rank, out in enumerate(results):
        for kind in ("sharded", "overlapped"):
            what = f"{kind} {backend} rank {rank}/{world}"
            _assert_same_bits(out["plain"], out[kind], what)
            _on_device(out["plain"])
            _on_device(out[kind], state=False)  # the share's state: below
            assert out[f"{kind} share devices"] == [gpu_device().type], what
            assert 0 < out[f"{kind} share"] <= plain_numel, what
            _assert_same_bits(out[kind], results[0][kind], f"{what} against rank 0")
    for kind in ("sharded", "overlapped"):  # the shares split the state between the ranks
        assert sum(out[f"{kind} share"] for out in results) == plain_numel, kind
        if world > 1:
            assert all(out[f"{kind} share"] < plain_numel for out in results), kind
