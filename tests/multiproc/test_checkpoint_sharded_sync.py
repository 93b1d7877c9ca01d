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

from lockstep.checkpoint import CheckpointManager, compare_checkpoints
from lockstep.checkpoint.compare import load_checkpoint
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.sharded import ShardPolicy, full_tensors, shard
from lockstep.errors import CheckpointError
from lockstep.jobs.models import TinyGPT
from lockstep.testing import run_distributed
from lockstep.trainer.reporting.metrics import TrainMetrics
from lockstep.trainer.run.low_comm import PeriodicRun
from lockstep.trainer.run.run_state import RunState

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


class _Position:
    """A stand-in for fit's sampler: its position, as a state_dict."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = int(state["index"])


def _build(sync: str, seed: int, degree: int = DEGREE, registry: bool = False) -> dict[str, Any]:
    """A sharded periodic model, its AdamW, and the checkpoint's state: the manager's entries as a user gives
    them, or (`registry`) fit's RunState's, with the periodic run's entries registered as fit does."""
    model = _gpt(seed)
    handle = shard(model, _policy(sync, degree))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    periodic = PeriodicRun(handle, model, optimizer)
    run = {"model": model, "handle": handle, "optimizer": optimizer, "periodic": periodic}
    if not registry:
        state = {"model": model, "optimizer": optimizer, "workers": periodic.workers, "progress": {"step": 0}}
        return {**run, "state": state}
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    metrics = TrainMetrics("lm", ordered=False)
    run_state = RunState(model, optimizer, scheduler, scaler, _Position(), metrics)
    run_state.register_outer_sync(periodic, streaming=sync == "streaming_diloco")
    return {**run, "state": run_state.registry.checkpoint_entries(), "run_state": run_state}


def _train(run: dict[str, Any], start: int, stop: int) -> None:
    model, optimizer, handle = run["model"], run["optimizer"], run["handle"]
    for step in range(start, stop):
        out = model(_batch(step, dist.get_rank())[:, :-1])
        target = _batch(step, dist.get_rank())[:, 1:]
        nn.functional.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.after_optimizer_step()
        if "run_state" in run:  # fit's schedule and counters move on with the steps
            run["run_state"].scheduler.step()
            run["run_state"].counters.step = step + 1


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """This group's full parameters (a collective inside the group)."""
    return {k: v.detach().clone() for k, v in full_tensors(model.state_dict()).items()}


def _uninterrupted(sync: str, registry: bool = False) -> dict[str, Any]:
    run = _build(sync, seed=0, registry=registry)
    _train(run, 0, SAVE)
    at_save = _full(run["model"])
    _train(run, SAVE, STEPS)
    run["handle"].flush_sync()
    return {"at_save": at_save, "final": _full(run["model"])}


def _save(sync: str, run_dir: str, blocking: bool = True, registry: bool = False) -> dict[str, Any]:
    run = _build(sync, seed=0, registry=registry)
    _train(run, 0, SAVE)
    in_flight = len(run["handle"].group_sync.outer.pending)
    round_end = run["periodic"].at_round_end()  # read through ShardHandle.sync_policy
    if not registry:
        run["state"]["progress"] = {"step": SAVE}
    manager = CheckpointManager(run_dir)
    manager.save(SAVE, run["state"], blocking=blocking)
    if not blocking:  # every rank's copy is taken: training may change the objects while the write goes on
        _train(run, SAVE, SAVE + 1)
        manager.wait()
    return {"in_flight": in_flight, "round_end": round_end}


def _resume(sync: str, run_dir: str, registry: bool = False) -> dict[str, torch.Tensor]:
    # other values than the saved run's: the checkpoint must bring them all back
    run = _build(sync, seed=7, registry=registry)
    step = CheckpointManager(run_dir).load(run["state"], required=True)
    progress = run["state"]["progress"]
    assert step == SAVE and (progress.step if registry else progress) == (
        SAVE if registry else {"step": SAVE}
    )
    _train(run, SAVE, STEPS)
    run["handle"].flush_sync()
    return _full(run["model"])


@pytest.mark.parametrize(
    ("sync", "blocking", "registry"),
    [
        ("diloco", True, False),
        ("streaming_diloco", True, False),
        ("streaming_diloco", False, False),  # a background save
        ("diloco", True, True),  # fit's RunState: its entries, as fit registers a sharded periodic run's
    ],
)
def test_a_sharded_periodic_run_saved_mid_round_resumes_bit_for_bit(
    sync: str, blocking: bool, registry: bool, tmp_path: Path
) -> None:
    run_dir = str(tmp_path / "run")
    reference = run_distributed(_uninterrupted, 4, args=(sync, registry), timeout=TIMEOUT)
    # mid-round the groups differ: one group's shards could not resume the other
    assert any(
        not torch.equal(v, reference[DEGREE]["at_save"][k]) for k, v in reference[0]["at_save"].items()
    )
    saved = run_distributed(_save, 4, args=(sync, run_dir, blocking, registry), timeout=TIMEOUT)
    assert [s["round_end"] for s in saved] == [False] * 4
    if sync == "streaming_diloco":
        assert [s["in_flight"] for s in saved] == [1] * 4  # a fragment's mean in flight at the save
    meta = json.loads((tmp_path / "run/checkpoints/step_000004/meta.json").read_text())
    assert meta["entries"]["workers"]["kind"] == "per_rank"
    assert meta["entries"]["workers"]["layout"] == {"world_size": 4, "shard_degree": DEGREE}
    # `lockstep compare` reads every rank's state, by rank
    step_dir = tmp_path / "run/checkpoints/step_000004"
    read = load_checkpoint(step_dir)
    assert sorted(read["workers"]) == ["rank0", "rank1", "rank2", "rank3"]
    # the shared `model` entry: replica group 0's values whole (a shard two groups hold, by the lowest rank)
    for name, value in reference[0]["at_save"].items():
        assert torch.equal(read["model"][name].to(value.dtype), value), f"the checkpoint's model: {name}"
    assert compare_checkpoints(step_dir, step_dir).equal
    if registry:  # the per-rank entry replaces the replicated run's `workers` + rank 0's `outer`
        assert "outer" not in meta["entries"] and meta["entries"]["scheduler"]["kind"] == "stateful"
    resumed = run_distributed(_resume, 4, args=(sync, run_dir, registry), timeout=TIMEOUT)
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
