"""GPU tier, the bucket tuner and torch.compile on CUDA (issue 38), with the bits their CPU tests promise.

- The bucket tuner (bucket_cap_mb="auto"): on CUDA it times whole steps between device synchronizations
  (engine/buckets/bucket_tuner.py); every candidate timed, the fixed-cap run's bits, the same choice on each rank;
  lockstep.fit with bucket_cap_mb="auto" on CUDA keeps the default run's bits.
- torch.compile with inductor (Triton kernels on CUDA) and the engine's graph splitting (issue 27): the
  split-compiled training (the drop-in class and replicate) equals torch's DDP compiled the same way, bit
  for bit.

Each at NCCL world 1 (NCCL takes one rank per GPU) and/or with gloo at world 2 (both ranks share the one
GPU). Rank functions hand back CPU copies (see test_gpu_features.py).

Where there is no GPU, LOCKSTEP_GPU_TIER_ON_CPU=1 runs this module on the CPU, to check the tests' own
logic before a GPU session: device "cpu", gloo in place of nccl, aot_eager in place of inductor (inductor
on CPU compiles C++ for minutes), the tuner's whole-step timing forced on (CUDA's path, without the
synchronization):
`LOCKSTEP_GPU_TIER_ON_CPU=1 OMP_NUM_THREADS=1 pytest tests/gpu/test_gpu_tuning_compile.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import lockstep
from lockstep.engine.buckets.bucket_tuner import TuningPlan
from lockstep.testing import run_distributed
from lockstep.trainer.settings.config import FitConfig
from tests.helpers import GPU_BACKEND, GPU_DEVICE, GPU_MARKS, GPU_TIER_ON_CPU, batch, build, gpu_device

pytestmark = GPU_MARKS
TIMEOUT = 240
STEPS = 3
# NCCL at world 1; gloo with CUDA tensors at world 2 (the only way two ranks share one GPU)
WORLDS = pytest.mark.parametrize(
    ("backend", "world"), [(GPU_BACKEND, 1), ("gloo", 2)], ids=["nccl1", "gloo2"]
)


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
