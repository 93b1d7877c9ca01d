"""CheckpointManager on real gloo ranks: exact resume (bitwise), and resume at another world size and wrapping.

World 2 trains 12 steps of a model with dropout (torch RNG), a loss scaled by python and numpy random
draws (their RNG), SGD with momentum, StepLR and a DistributedSampler, saving at steps 3 and 7. Then the
same processes scramble every RNG, build fresh objects from another seed, load (step 7) and train to step
12: the parameters are bitwise those of the uninterrupted run. World 3 then loads that run's last
checkpoint into a bare model, lockstep's DistributedDataParallel and a replicate handle.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep.checkpoint import CheckpointManager
from lockstep.checkpoint import rng as rng_state
from lockstep.data import DistributedSampler
from lockstep.runtime import get_rank
from lockstep.testing import run_distributed

STEPS, SAVES = 12, (3, 7)


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 6, generator=gen)
    return TensorDataset(x, x @ torch.randn(6, 2, generator=gen))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))


def _objects(seed: int) -> dict[str, Any]:
    model = _model(seed)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return {
        "model": ddp,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5),
        "sampler": DistributedSampler(_data(), seed=1),
        "step": 0,
    }


def _train(state: dict[str, Any], stop: int, manager: CheckpointManager, saves: tuple[int, ...]) -> None:
    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    # Every iter() of a DataLoader draws its workers' base seed from the global torch RNG unless it has a
    # generator of its own; a resumed run calls iter() at another step, so the loader gets its own.
    loader = DataLoader(_data(), batch_size=4, sampler=state["sampler"], generator=torch.Generator())
    batches = iter(loader)
    while state["step"] < stop:
        try:
            x, y = next(batches)
        except StopIteration:
            state["sampler"].set_epoch(state["sampler"].epoch + 1)  # iter() alone repeats the epoch, as torch
            batches = iter(loader)
            continue
        scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        loss = nn.functional.mse_loss(model(x), y) * scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        state["step"] += 1
        if state["step"] in saves:
            manager.save(state["step"], state)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _fingerprint() -> str:
    return hashlib.sha256(json.dumps(rng_state.capture()).encode()).hexdigest()


def _stop_and_resume(run_dir: str) -> dict[str, Any]:
    rank = get_rank()
    manager = CheckpointManager(run_dir, keep=2)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(100 + rank)
    reference = _objects(seed=0)
    _train(reference, STEPS, manager, SAVES)
    random.seed(555)  # a fresh start would have other streams and other weights
    np.random.seed(555)
    torch.manual_seed(555)
    resumed = _objects(seed=9)
    loaded = manager.load(resumed)
    after_load = resumed["step"]
    _train(resumed, STEPS, manager, (10, 12))
    return {
        "loaded": loaded,
        "step_after_load": after_load,
        "reference": _flat(reference["model"]),
        "resumed": _flat(resumed["model"]),
        "rng": _fingerprint(),
        "momentum": torch.cat([s["momentum_buffer"].flatten() for s in resumed["optimizer"].state.values()]),
        "sampler": resumed["sampler"].state_dict(),
    }


def _load_at_three(run_dir: str) -> dict[str, Any]:
    manager = CheckpointManager(run_dir)
    out: dict[str, Any] = {"params": []}
    for wrap in ("bare", "lockstep_ddp", "replicate"):
        model = _model(seed=get_rank() + 7)
        target: Any = model
        if wrap == "lockstep_ddp":
            target = lockstep.DistributedDataParallel(model)
        elif wrap == "replicate":
            target = lockstep.replicate(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sampler = DistributedSampler(_data(), seed=1)
        state = {"model": target, "optimizer": optimizer, "sampler": sampler, "step": -1}
        out["step"] = manager.load(state)
        out["params"].append(_flat(model))
        out["momentum"] = torch.cat([s["momentum_buffer"].flatten() for s in optimizer.state.values()])
        out["sampler_consumed"] = sampler.num_consumed
        out["rng"] = _fingerprint()
    if get_rank() == 2:  # no saved streams for this rank: seeded from (step, rank)
        rng_state.seed_new_rank(12, 2)
        out["expected_rng"] = _fingerprint()
    return out


def test_resume_is_bitwise_exact_and_loads_at_another_world_size_wrapped_or_not(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    two = run_distributed(_stop_and_resume, 2, args=(run_dir,), timeout=120)
    for rank in two:
        assert rank["loaded"] == 7 and rank["step_after_load"] == 7  # plain values come back too
        assert torch.equal(rank["resumed"], rank["reference"])  # bitwise, dropout and all
    assert torch.equal(two[0]["resumed"], two[1]["resumed"])
    assert two[0]["rng"] != two[1]["rng"]  # per-rank streams, each restored to its own

    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000010", "step_000012"]  # keep=2
    assert (checkpoints / "latest").read_text().strip() == "step_000012"
    newest = checkpoints / "step_000012"
    meta = json.loads((newest / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == 12 and meta["versions"]["torch"] == torch.__version__
    assert sorted(meta["files"]) == ["model.safetensors", "rng.json", "state.pt"]
    for name, record in meta["files"].items():
        assert hashlib.sha256((newest / name).read_bytes()).hexdigest() == record["sha256"]
    weights = safetensors.torch.load_file(str(newest / "model.safetensors"))
    assert sorted(weights) == ["0.bias", "0.weight", "3.bias", "3.weight"]  # stored without `module.`
    assert torch.equal(
        torch.cat([weights[k].flatten() for k in ("0.weight", "0.bias", "3.weight", "3.bias")]),
        two[0]["resumed"],
    )
    training = torch.load(newest / "state.pt", weights_only=True)["entries"]
    assert training["step"] == 12 and training["sampler"] == two[0]["sampler"]

    three = run_distributed(_load_at_three, 3, args=(run_dir,), timeout=120)
    for rank, out in enumerate(three):
        assert out["step"] == 12
        for params in out["params"]:  # bare, lockstep.DistributedDataParallel, replicate handle
            assert torch.equal(params, two[0]["resumed"])
        assert torch.equal(out["momentum"], two[0]["momentum"])
        assert out["sampler_consumed"] == two[0]["sampler"]["num_consumed"]
        assert out["rng"] == (two[rank]["rng"] if rank < 2 else out["expected_rng"])
