"""GPU tier, the engine's features that never ran on CUDA (issue 38): each on CUDA tensors, with the bits
its CPU tests promise.

- The overlapped optimizer step (the optimizer steps each bucket during backward): the plain step's bits.
- The sharded optimizer, plain and overlapped (the owners' broadcasts of the updated shards, a 1 MiB
  weight in place, the rest packed or cut in pieces): the unsharded run's parameters and full state.
- The bucket tuner (bucket_cap_mb="auto"): on CUDA it times whole steps between device synchronizations
  (engine/bucket_tuner.py); every candidate timed, the fixed-cap run's bits, the same choice on each rank.
- torch.compile with inductor (Triton kernels on CUDA) and the engine's graph splitting (issue 27): the
  split-compiled training equals torch's DDP compiled the same way, bit for bit.

Each at NCCL world 1 (NCCL takes one rank per GPU) and with gloo at world 2 (both ranks share the one GPU;
gloo moves CUDA tensors through host memory). Rank functions hand back CPU copies: a CUDA tensor returned
to the parent would travel by CUDA IPC from a process that exits. The periodic sync modes are
test_gpu_sync.py.

Where there is no GPU, LOCKSTEP_GPU_TIER_ON_CPU=1 runs this module on the CPU, to check the tests' own
logic before a GPU session: device "cpu", gloo in place of nccl, aot_eager in place of inductor (inductor
on CPU compiles C++ for minutes), the tuner's whole-step timing forced on (CUDA's path, without the
synchronization):
`LOCKSTEP_GPU_TIER_ON_CPU=1 OMP_NUM_THREADS=1 pytest tests/gpu/test_gpu_features.py`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import lockstep
import lockstep.hooks
from lockstep.engine.bucket_tuner import TuningPlan
from lockstep.testing import run_distributed
from lockstep.trainer.config import FitConfig
from tests.helpers import (
    GPU_BACKEND,
    GPU_DEVICE,
    GPU_MARKS,
    GPU_TIER_ON_CPU,
    batch,
    build,
    gpu_device,
    small_batch,
)

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


# ---------------------------------------------------------------- the bucket tuner

# Caps small enough that ManySmall (28 small parameters) gets a distinct layout for each; on the CPU the
# whole-step timing of CUDA is forced on, so that its path runs here too (without the synchronization).
PLAN = TuningPlan(
    caps_mb=(0.0002, 0.0005, 0.002),
    passes=2,
    warmup=1,
    measured=1,
    whole_steps=True if GPU_TIER_ON_CPU else None,
)
TUNED_STEPS = 2 + 4 * 2 * 2 + 2  # the first step, the rebuild's, 4 candidates x 2 passes x 2, then 2 more


def _tuned_and_fixed() -> dict[str, Any]:
    device, rank = gpu_device(), dist.get_rank()
    out: dict[str, Any] = {}
    for auto in (True, False):
        module = build("many_small", 0).to(device)
        handle = lockstep.replicate(
            module, policy=lockstep.SyncPolicy(bucket_cap_mb="auto" if auto else 25.0)
        )
        if auto:
            handle._replica.mode.tuner.plan = PLAN  # type: ignore[attr-defined]  # the test's small caps
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        grads = []
        for step in range(TUNED_STEPS):
            x, y = batch(rank, step)
            F.cross_entropy(module(x.to(device)), y.to(device)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]).cpu())  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
        out["auto" if auto else "fixed"] = {
            "grads": grads,
            "params": [p.detach().cpu().clone() for p in module.parameters()],
            "devices": sorted({p.device.type for p in module.parameters()}),
            "extras": handle.stats().extras,
            "layout": [tuple(b.indices) for b in handle._replica.reducer.buckets],  # type: ignore[attr-defined]
        }
        handle.remove()
    return out


@WORLDS
def test_the_bucket_tuner_times_synchronized_steps_and_keeps_the_bits_on_cuda(
    backend: str, world: int
) -> None:
    outs = run_distributed(_tuned_and_fixed, world, backend=backend, timeout=TIMEOUT)
    for rank, out in enumerate(outs):
        auto, fixed, extras = out["auto"], out["fixed"], out["auto"]["extras"]
        assert auto["devices"] == [gpu_device().type]
        assert extras["bucket_tuning"] == "done", (rank, extras)
        assert extras["bucket_timing"] == "whole steps, device synchronized", extras
        trials = extras["bucket_trials"]
        assert [t["cap_mb"] for t in trials] == [0.0002, 0.0005, 0.002, 25.0], trials
        assert all(len(t["step_ms"]) == 2 and min(t["step_ms"]) > 0 for t in trials), trials
        assert extras["bucket_cap_mb"] in [t["cap_mb"] for t in trials] and extras["bucket_tuning_reason"]
        chosen = next(t for t in trials if t["cap_mb"] == extras["bucket_cap_mb"])
        assert len(auto["layout"]) == chosen["num_buckets"]
        # world 1 or 2: the layout cannot change a bit (one term, or two-term sums that commute)
        for step, (a, f) in enumerate(zip(auto["grads"], fixed["grads"], strict=True)):
            assert torch.equal(a, f), f"{backend} rank {rank} step {step}: gradients differ"
        for a, f in zip(auto["params"], fixed["params"], strict=True):
            assert torch.equal(a, f), f"{backend} rank {rank}: parameters differ"
    for out in outs[1:]:  # the same numbers (max over ranks), the same choice, the same layout
        assert out["auto"]["extras"]["bucket_trials"] == outs[0]["auto"]["extras"]["bucket_trials"]
        assert out["auto"]["layout"] == outs[0]["auto"]["layout"]


def _fit_tuned_and_default(run_dir: str) -> dict[str, Any]:
    """fit with bucket_cap_mb="auto" and with the default, on the GPU: 12 layers of 256 x 256 (3 MiB of
    gradients), so that 1 MiB and 25 MiB give different buckets (tests/multiproc/test_fit_bucket_tuning.py)."""
    out = {}
    for cap in ("auto", None):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(12):
            layers += [nn.Linear(256, 256), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(256, 4))
        x = torch.randn(640, 256, generator=torch.Generator().manual_seed(3))
        config = FitConfig(
            run_dir=f"{run_dir}/{cap}",
            device=GPU_DEVICE,
            batch_size=8,
            grad_accum_steps=2,  # no_sync micro-steps through the handle too
            max_steps=18,
            optimizer="adamw",
            task="regression",
            progress="none",
            bucket_cap_mb=cap,
        )
        data = TensorDataset(x, x[:, :4].clone())
        out[str(cap)] = lockstep.fit(model, data, loss_fn=F.mse_loss, config=config).summary
        assert {p.device.type for p in model.parameters()} == {GPU_DEVICE}
    return out


def test_fit_tunes_the_bucket_size_on_cuda_and_keeps_the_default_runs_bits(tmp_path: Path) -> None:
    for out in run_distributed(_fit_tuned_and_default, 2, args=(str(tmp_path),), timeout=TIMEOUT):
        tuned, default = out["auto"], out["None"]
        # fit cannot force the whole-step timing on the CPU (the engine test above does)
        timing = "backward + finalize" if GPU_TIER_ON_CPU else "whole steps, device synchronized"
        assert tuned["bucket_timing"] == timing, tuned
        trials = tuned["bucket_trials"]
        assert [t["cap_mb"] for t in trials] == [1.0, 25.0], trials
        assert all(len(t["step_ms"]) == 4 and min(t["step_ms"]) > 0 for t in trials), trials
        assert tuned["steps"] == default["steps"] == 18
        assert tuned["params_sha256"] == default["params_sha256"]  # world 2: two-term sums commute
        assert tuned["optimizer_sha256"] == default["optimizer_sha256"]


# ---------------------------------------------------------------- torch.compile, split at the buckets

COMPILE_BACKEND = "aot_eager" if GPU_TIER_ON_CPU else "inductor"  # inductor: Triton kernels on CUDA
CAP_MB = 1.0  # the 512 x 512 layers (1 MiB each) make several buckets, so several graph pieces


class CompileNet(nn.Module):
    """Its own forward (dynamo compiles it inside the wrapper): 64 -> 512 -> 512 -> 512 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(64, 512)
        self.hidden = nn.ModuleList(nn.Linear(512, 512) for _ in range(2))
        self.out = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


def _compiled_pieces(root: torch.Tensor) -> int:
    """How many compiled graph pieces the backward of `root` runs (one CompiledFunctionBackward each)."""
    seen, stack, found = set(), [root.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += type(node).__name__.startswith("CompiledFunction")
        stack.extend(n for n, _ in node.next_functions)
    return found


def _train_compiled(engine: str) -> dict[str, Any]:
    torch._dynamo.reset()
    device, rank = gpu_device(), dist.get_rank()
    module = CompileNet().to(device)
    compiled = torch.compile(module, backend=COMPILE_BACKEND)
    if engine == "replicate":
        lockstep.replicate(compiled, policy=lockstep.SyncPolicy(bucket_cap_mb=CAP_MB, first_bucket_mb=CAP_MB))
        model: nn.Module = compiled
    else:
        cls = (
            lockstep.DistributedDataParallel
            if engine == "ours"
            else torch.nn.parallel.DistributedDataParallel
        )
        model = cls(compiled, bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    pieces = 0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        pieces = _compiled_pieces(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch._dynamo.reset()
    return {
        "params": [p.detach().cpu().clone() for p in module.parameters()],
        "devices": sorted({p.device.type for p in module.parameters()}),
        "pieces": pieces,
    }


def _compiled_all() -> dict[str, Any]:
    # one start of the ranks for the three; inductor's cache serves the pieces compiled before
    return {engine: _train_compiled(engine) for engine in ("ours", "replicate", "torch")}


@WORLDS
def test_split_compiled_training_equals_torch_ddp_compiled_on_cuda(backend: str, world: int) -> None:
    for rank, out in enumerate(run_distributed(_compiled_all, world, backend=backend, timeout=TIMEOUT)):
        theirs = out["torch"]
        for engine in ("ours", "replicate"):
            ours, what = out[engine], f"{engine} {backend} rank {rank}/{world}"
            assert ours["devices"] == [gpu_device().type], what
            # dynamo split both at the buckets, into the same pieces, so the same kernels ran
            assert ours["pieces"] >= 2 and ours["pieces"] == theirs["pieces"], (
                what,
                ours["pieces"],
                theirs["pieces"],
            )
            for i, (a, b) in enumerate(zip(ours["params"], theirs["params"], strict=True)):
                assert torch.equal(a, b), f"{what}: parameter {i} differs by {(a - b).abs().max()}"
