"""Checkpoints of a sharded periodic run (ShardPolicy.sync: replica groups of FSDP2 shards meeting every H
steps) on 4 real gloo ranks, 2 groups of 2. Saved mid-round, when the groups' parameters and inner AdamW
states differ (and, streaming, a fragment's mean is in flight), every rank's own state is written by that rank
(the `workers` entry, held rank by rank); built afresh in new processes and loaded, the run continues bit for
bit like the uninterrupted one, in every group (from a background save too). At another layout the load is
refused on every rank, saying how to resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lockstep.checkpoint import CheckpointManager
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.sharded import ShardPolicy, full_tensors, shard
from lockstep.errors import CheckpointError
from lockstep.jobs.models import TinyGPT
from lockstep.testing import run_distributed
from lockstep.trainer.run.low_comm import PeriodicRun

TIMEOUT = 300
VOCAB = 29
STEPS = 8
SAVE = 4  # mid-round: diloco's rounds end at 3 and 6; streaming launched fragment 0 after step 4
EVERY = 3
DEGREE = 2  # 4 ranks: 2 groups of 2


def _gpt(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(VOCAB, context=16, dim=32, depth=3, heads=4)


def _batch(step: int, rank: int) -> torch.Tensor:
    """Step `step`'s batch of rank `rank`: 2 sequences, its own (each group trains on its own data)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 17), generator=g)


def _policy(sync: str, degree: int = DEGREE) -> ShardPolicy:
    fragments = 2 if sync == "streaming_diloco" else 1
    periodic = SyncPolicy(sync=sync, sync_every=EVERY, outer_lr=0.7, outer_momentum=0.9, fragments=fragments)
    return ShardPolicy(shard_degree=degree, sync=periodic)


def _build(sync: str, seed: int, degree: int = DEGREE) -> dict[str, Any]:
    """A sharded periodic model, its AdamW, and the checkpoint's state as fit's run registers it."""
    model = _gpt(seed)
    handle = shard(model, _policy(sync, degree))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    periodic = PeriodicRun(handle, model, optimizer)
    state = {"model": model, "optimizer": optimizer, "workers": periodic.workers, "progress": {"step": 0}}
    return {"model": model, "handle": handle, "optimizer": optimizer, "state": state}


def _train(run: dict[str, Any], start: int, stop: int) -> None:
    model, optimizer, handle = run["model"], run["optimizer"], run["handle"]
    for step in range(start, stop):
        out = model(_batch(step, dist.get_rank())[:, :-1])
        target = _batch(step, dist.get_rank())[:, 1:]
        nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.after_optimizer_step()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """This group's full parameters (a collective inside the group)."""
    return {k: v.detach().clone() for k, v in full_tensors(model.state_dict()).items()}


def _uninterrupted(sync: str) -> dict[str, Any]:
    run = _build(sync, seed=0)
    _train(run, 0, SAVE)
    at_save = _full(run["model"])
    _train(run, SAVE, STEPS)
    run["handle"].flush_sync()
    return {"at_save": at_save, "final": _full(run["model"])}


def _save(sync: str, run_dir: str, blocking: bool = True) -> dict[str, Any]:
    run = _build(sync, seed=0)
    _train(run, 0, SAVE)
    in_flight = len(run["handle"].outer.pending)
    run["state"]["progress"] = {"step": SAVE}
    manager = CheckpointManager(run_dir)
    manager.save(SAVE, run["state"], blocking=blocking)
    if not blocking:  # every rank's copy is taken: training may change the objects while the write goes on
        _train(run, SAVE, SAVE + 1)
        manager.wait()
    return {"in_flight": in_flight}


def _resume(sync: str, run_dir: str) -> dict[str, torch.Tensor]:
    run = _build(sync, seed=7)  # other values than the saved run's: the checkpoint must bring them all back
    step = CheckpointManager(run_dir).load(run["state"], required=True)
    assert step == SAVE and run["state"]["progress"] == {"step": SAVE}
    _train(run, SAVE, STEPS)
    run["handle"].flush_sync()
    return _full(run["model"])


@pytest.mark.parametrize(
    ("sync", "blocking"), [("diloco", True), ("streaming_diloco", True), ("streaming_diloco", False)]
)
def test_a_sharded_periodic_run_saved_mid_round_resumes_bit_for_bit(
    sync: str, blocking: bool, tmp_path: Path
) -> None:
    run_dir = str(tmp_path / "run")
    reference = run_distributed(_uninterrupted, 4, args=(sync,), timeout=TIMEOUT)
    # mid-round the groups differ: one group's shards could not resume the other
    assert any(
        not torch.equal(v, reference[DEGREE]["at_save"][k]) for k, v in reference[0]["at_save"].items()
    )
    saved = run_distributed(_save, 4, args=(sync, run_dir, blocking), timeout=TIMEOUT)
    if sync == "streaming_diloco":
        assert [s["in_flight"] for s in saved] == [1] * 4  # a fragment's mean in flight at the save
    meta = json.loads((tmp_path / "run/checkpoints/step_000004/meta.json").read_text())
    assert meta["entries"]["workers"]["kind"] == "per_rank"
    assert meta["entries"]["workers"]["layout"] == {"world_size": 4, "shard_degree": DEGREE}
    resumed = run_distributed(_resume, 4, args=(sync, run_dir), timeout=TIMEOUT)
    for rank, final in enumerate(resumed):
        expected = reference[rank]["final"]
        assert final.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(final[name], value), f"rank {rank}: {name} differs from the uninterrupted run"
    if sync == "diloco":  # step 8 is mid-round again: the groups still differ, each resumed its own
        assert any(not torch.equal(v, resumed[DEGREE][k]) for k, v in resumed[0].items())


def _refused(sync: str, run_dir: str, degree: int) -> str:
    run = _build(sync, seed=7, degree=degree)
    try:
        CheckpointManager(run_dir).load(run["state"], required=True)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.parametrize(("world", "degree"), [(4, 1), (2, 1)])
def test_a_sharded_periodic_checkpoint_at_another_layout_is_refused_on_every_rank(
    world: int, degree: int, tmp_path: Path
) -> None:
    run_dir = str(tmp_path / "run")
    run_distributed(_save, 4, args=("diloco", run_dir), timeout=TIMEOUT)
    messages = run_distributed(_refused, world, args=("diloco", run_dir, degree), timeout=TIMEOUT)
    for rank, message in enumerate(messages):
        assert message.startswith(f"[rank {rank}/{world}] "), message
        assert "this checkpoint of a sharded periodic run was saved on 4 ranks in groups of 2" in message
        assert f"this run has {world} ranks in groups of {degree}" in message
        assert "resume with -n 4 --shard-degree 2" in message
