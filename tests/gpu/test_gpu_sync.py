"""GPU tier, the periodic sync modes on CUDA tensors (issue 38): local SGD, DiLoCo, streaming DiLoCo with
fragment_delay 2, quantized outer gradients (int8, int4) and bfloat16 deltas, and lockstep.fit with them.

- The modes against their reference on the same device (tests.helpers.outer_reference, the one that
  tests/multiproc/test_outer_sync.py checks the CPU path with): every worker in one process, the outer
  math written out. Gloo at world 2 with CUDA tensors (both ranks share the one GPU); NCCL at world 1
  for the unquantized modes (alone, no mean is quantized: the reference's round trip does not apply).
- fit with a sync mode on CUDA: a run stopped mid-round resumes with the uninterrupted run's bits.

Rank functions hand back CPU copies (a CUDA tensor returned to the parent would travel by CUDA IPC from a
process that exits). LOCKSTEP_GPU_TIER_ON_CPU=1 runs this module on the CPU (device "cpu", gloo in place
of nccl), to check the tests' own logic where no GPU is:
`LOCKSTEP_GPU_TIER_ON_CPU=1 OMP_NUM_THREADS=1 pytest tests/gpu/test_gpu_sync.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.jobs import catalog
from lockstep.testing import run_distributed
from tests.helpers import (
    GPU_BACKEND,
    GPU_DEVICE,
    GPU_MARKS,
    OUTER_EVERY,
    OUTER_STEPS,
    gpu_device,
    outer_inner,
    outer_model,
    outer_reference,
)

pytestmark = GPU_MARKS
TIMEOUT = 240
# (sync, SyncPolicy fields); the reference takes the same sync, wire (delta_dtype) and fragment_delay
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "local_sgd": ("local_sgd", {}),
    "diloco": ("diloco", {}),
    "streaming_delay2": ("streaming_diloco", {"fragment_delay": 2}),
    "diloco_int8": ("diloco", {"delta_dtype": "int8"}),
    "diloco_int4": ("diloco", {"delta_dtype": "int4"}),
    "diloco_bf16": ("diloco", {"delta_dtype": torch.bfloat16}),
}
UNQUANTIZED = ["local_sgd", "diloco", "streaming_delay2"]


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu().clone() for name, value in state.items()}


def _train(sync: str, extra: dict[str, Any]) -> dict[str, Any]:
    """This rank as one worker of the reference: its model, AdamW and data, the engine's outer sync."""
    device = gpu_device()
    model = outer_model(device=device)
    streaming = {"fragments": 2, "fragment_layout": "strided"} if sync == "streaming_diloco" else {}
    policy = lockstep.SyncPolicy(sync=sync, sync_every=OUTER_EVERY, **streaming, **extra)
    handle = lockstep.replicate(model, policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    synced = []
    for step in range(OUTER_STEPS):
        outer_inner(model, opt, dist.get_rank(), step)
        synced.append(handle.after_optimizer_step())
    devices = {t.device.type for t in model.state_dict().values()}
    handle.remove()
    return {"state": _cpu(model.state_dict()), "devices": sorted(devices), "synced": synced}


def _modes_and_reference(names: list[str]) -> dict[str, Any]:
    """Each mode in turn on this rank; rank 0 also runs the reference of each on the same device."""
    world, out = dist.get_world_size(), {}
    for name in names:
        sync, extra = MODES[name]
        out[name] = _train(sync, extra)
        if dist.get_rank() == 0:
            wire = extra.get("delta_dtype")
            want = outer_reference(
                sync, world, wire, "strided", extra.get("fragment_delay", 1), device=GPU_DEVICE
            )
            out[name]["reference"] = [_cpu(state) for state in want]
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert got.keys() == want.keys(), where
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{where}: {name} differs by {(got[name] - value).abs().max()}"


@pytest.mark.parametrize(
    ("backend", "world", "names"),
    [("gloo", 2, sorted(MODES)), (GPU_BACKEND, 1, UNQUANTIZED)],
    ids=["gloo2-all", "nccl1-unquantized"],
)
def test_periodic_modes_on_cuda_give_their_references_bits(
    backend: str, world: int, names: list[str]
) -> None:
    outs = run_distributed(_modes_and_reference, world, args=(names,), backend=backend, timeout=TIMEOUT)
    for name in names:
        want = outs[0][name]["reference"]
        for rank, out in enumerate(outs):
            got = out[name]
            _assert_same(got["state"], want[rank], f"{name} {backend} rank {rank}/{world}")
            assert got["devices"] == [GPU_DEVICE], (name, got["devices"])
            if name != "streaming_delay2":  # step 9 closes a round: every replica the same
                _assert_same(got["state"], outs[0][name]["state"], f"{name} rank {rank} against rank 0")
                assert got["synced"] == [False, False, True] * (OUTER_STEPS // OUTER_EVERY), got["synced"]
    if world > 1:  # the quantized wire changed something: the test can tell the formats apart
        assert not torch.equal(
            outs[0]["diloco_int4"]["state"]["0.weight"], outs[0]["diloco"]["state"]["0.weight"]
        )


# ---------------------------------------------------------------- lockstep.fit with a sync mode

SETTINGS: dict[str, Any] = {
    "num_samples": 128,  # 8 steps of 8 samples a rank at world 2
    "batch_size": 8,
    "epochs": 1,
    "log_every": 4,
    "sync_every": 3,
    "checkpoint_every": 4,
}


def _fit(run_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    config_cls, _ = catalog.job("toy")
    config = config_cls(run_dir=run_dir, progress="none", device=GPU_DEVICE, **{**SETTINGS, **settings})
    built = catalog.build("toy", config)
    result = lockstep.fit(built.model, built.train_data, loss_fn=built.loss_fn, config=config)
    assert {p.device.type for p in built.model.parameters()} == {GPU_DEVICE}
    return result.summary


def _straight_and_resumed(run_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The uninterrupted run, then one stopped mid-round (5 = a round of 3 and 2 steps) and resumed."""
    return {
        "straight": _fit(f"{run_dir}/straight", settings),
        "stopped": _fit(f"{run_dir}/resumed", {**settings, "max_steps": 5}),
        "resumed": _fit(f"{run_dir}/resumed", settings),
    }


def _last_checkpoint(run_dir: Path) -> dict[str, Any]:
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return torch.load(last / "state.pt", weights_only=True, map_location="cpu")["entries"]


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = (
        tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    )
    return {key: value for k, v in items for key, value in _tensors(v, f"{prefix}/{k}").items()}


@pytest.mark.parametrize(
    ("backend", "world", "sync", "sync_dtype"),
    [
        ("gloo", 2, "diloco", "int8"),
        ("gloo", 2, "streaming_diloco", "fp32"),
        # each checkpoint gathers every rank's state to rank 0 (AdamW's step counts are CPU tensors: NCCL
        # takes them once moved to the GPU)
        (GPU_BACKEND, 1, "diloco", "fp32"),
    ],
    ids=["gloo2-diloco-int8", "gloo2-streaming", "nccl1-diloco"],
)
def test_fit_with_a_sync_mode_on_cuda_resumes_mid_round_with_the_same_bits(
    backend: str, world: int, sync: str, sync_dtype: str, tmp_path: Path
) -> None:
    settings = {"sync": sync, "sync_dtype": sync_dtype, "fragments": 2 if sync == "streaming_diloco" else 1}
    args = (str(tmp_path), settings)
    runs = run_distributed(_straight_and_resumed, world, args=args, backend=backend, timeout=TIMEOUT)
    for rank, out in enumerate(runs):
        total = SETTINGS["num_samples"] // (SETTINGS["batch_size"] * world)  # one epoch
        assert out["stopped"]["steps"] == 5 and out["straight"]["steps"] == out["resumed"]["steps"] == total
        assert out["resumed"]["params_sha256"] == out["straight"]["params_sha256"], rank
        assert out["resumed"]["optimizer_sha256"] == out["straight"]["optimizer_sha256"], rank
    straight, resumed = _last_checkpoint(tmp_path / "straight"), _last_checkpoint(tmp_path / "resumed")
    for entry in ("workers", "outer"):  # every rank's parameters and inner state; the anchor, the momentum
        a, b = _tensors(straight[entry]), _tensors(resumed[entry])
        assert a and a.keys() == b.keys(), entry
        for key in a:
            assert torch.equal(a[key], b[key]), f"{sync} {sync_dtype}: {entry}{key} differs"
