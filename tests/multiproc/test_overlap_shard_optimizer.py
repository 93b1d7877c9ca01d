"""The overlapped optimizer with sharded state, on real gloo ranks: `handle.overlap_optimizer(
handle.shard_optimizer(optimizer))` and fit with overlap_optimizer and shard_optimizer both on.

Each rank trains two replicas of the same model on the same data in one process: one with the plain,
unsharded optimizer stepped after backward, one whose buckets the engine steps during backward on this
rank's share, with the owners' broadcasts started right after. Parameters and the consolidated optimizer
state must equal the plain run's bit for bit, the state must be split over the ranks, and the counters
must show steps and broadcasts during backward (the overlapped model's backward waits between its last
and middle layers until the first buckets' all-reduces are back: an event, tests.helpers.WaitInBackward,
not a sleep that a loaded machine can outlast). Fallbacks take the plain sharded
step and say why once; fit's checkpoints resume exactly into and out of an unsharded, plain run.
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

import lockstep
from lockstep.checkpoint import compare_checkpoints
from lockstep.errors import ConfigError, UsageError
from lockstep.jobs import catalog
from lockstep.testing import run_distributed
from tests.helpers import ReductionsStarted, WaitInBackward, small_batch, warmup_decay

TINY_BUCKETS = {"bucket_cap_mb": 1e-4, "first_bucket_mb": 1e-4}  # about one parameter per bucket
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),  # not known to overlap: falls back
}


class _Net(nn.Module):
    """inp -> mid -> out; `spare` only where `use_spare` (per rank: find_unused_parameters)."""

    def __init__(self, *, watch: ReductionsStarted | None = None, spare: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid = nn.Linear(8, 16), nn.Linear(16, 16)
        self.spare = nn.Linear(16, 16) if spare else None
        self.out = nn.Linear(16, 3)
        self.use_spare, self.watch = False, watch  # backward waits for the reductions started before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        if self.spare is not None and self.use_spare:
            h = h + self.spare(h)
        return self.out(WaitInBackward.apply(h, self.watch))


def _flat(state: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"{index}.{key}", torch.as_tensor(value).clone())
        for index, entry in sorted(state["state"].items())
        for key, value in sorted(entry.items())
    ]


def _assert_same_bits(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    for i, (x, y) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert torch.equal(x, y), f"{what}: parameter {i} differs"
    assert [k for k, _ in a["state"]] == [k for k, _ in b["state"]], f"{what}: state entries differ"
    for (key, x), (_, y) in zip(a["state"], b["state"]):
        assert torch.equal(x, y), f"{what}: optimizer state {key} differs"
    assert a["groups"] == b["groups"], f"{what}: param_groups differ"


def _bits(net: nn.Module, full_state: dict[str, Any]) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "state": _flat(full_state),
        "groups": full_state["param_groups"],
    }


def _warned(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "overlap_optimizer" in str(w.message)]


# ---------------------------------------------------------------- the unsharded plain step's bits


def _train_both(name: str, unused: bool, steps: int, kind: str = "") -> dict[str, Any]:
    """The plain unsharded run and the overlapped sharded one; `kind` names a fallback to provoke."""
    rank = dist.get_rank()
    policy = lockstep.SyncPolicy(find_unused_parameters=unused, deterministic=kind == "deterministic")
    if kind != "deterministic":
        policy = lockstep.SyncPolicy(find_unused_parameters=unused, **TINY_BUCKETS)
    watch = ReductionsStarted()
    plain_net, net = _Net(spare=unused), _Net(watch=None if kind else watch, spare=unused)
    plain_handle, handle = (
        lockstep.replicate(plain_net, policy=policy),
        lockstep.replicate(net, policy=policy),
    )
    plain, inner = OPTIMIZERS[name](plain_net.parameters()), OPTIMIZERS[name](net.parameters())
    schedules = [torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay) for opt in (plain, inner)]
    with warnings.catch_warnings(record=True) as caught, watch:
        warnings.simplefilter("always")
        sharded = handle.shard_optimizer(inner, piece_numel=100)  # the 16x16 weights in 3 pieces
        overlapped = handle.overlap_optimizer(sharded, clip_grad_norm=kind == "clip")
        for step in range(steps):
            x, y = small_batch(rank, step)
            plain_net.use_spare = net.use_spare = unused and rank == 1 and step % 2 == 0
            for each, model, opt, schedule in (
                (plain_handle, plain_net, plain, schedules[0]),
                (handle, net, overlapped, schedules[1]),
            ):
                opt.zero_grad(set_to_none=True)
                if kind in ("accumulate", "deterministic"):
                    each.accumulate(
                        lambda b, m=model: F.cross_entropy(m(b[0]), b[1]).backward(),
                        {k: small_batch(k, step) for k in each.owned_micro_batches(4)},
                        num_micro_batches=4,
                        step=step,
                    )
                else:
                    F.cross_entropy(model(x), y).backward()
                if kind == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
                schedule.step()
    overlapped.consolidate_state_dict(to=None)  # the ShardedOptimizer's, through the wrapper
    mine = sum(t.numel() for s in sharded.state.values() for t in s.values() if t.dim() > 0)
    units = sharded.units
    return {
        "plain": _bits(plain_net, plain.state_dict()),
        "overlapped": _bits(net, overlapped.state_dict()),
        "state_numel": mine,
        "plain_state_numel": sum(t.numel() for s in plain.state.values() for t in s.values() if t.dim() > 0),
        "owned": sorted(u for u, owner in enumerate(sharded.owners) if owner == rank),
        "with_state": sorted(u for u, t in enumerate(units.tensors) if t in sharded.state),
        "own_state_entries": len(inner.state),  # the optimizer's own: empty, its share is sharded.state
        "in_backward": overlapped.buckets_stepped_in_backward,
        "stepped": overlapped.buckets_stepped_in_backward + overlapped.buckets_stepped_at_finalize,
        "extras": handle.stats().extras,
        "num_buckets": handle.stats().num_buckets if kind != "deterministic" else 0,
        "warnings": _warned(caught),
        "reasons": overlapped.fallback_reasons,
    }


def _check_bits(results: list[dict[str, Any]], what: str) -> None:
    for rank, out in enumerate(results):
        where = f"{what} rank {rank}/{len(results)}"
        _assert_same_bits(out["plain"], out["overlapped"], where)
        _assert_same_bits(results[0]["overlapped"], out["overlapped"], f"{where} against rank 0")
        assert out["with_state"] == out["owned"], f"{where}: optimizer state outside this rank's share"
        assert out["own_state_entries"] == 0, where
    assert sum(out["state_numel"] for out in results) == results[0]["plain_state_numel"], what
    assert all(0 < out["state_numel"] < out["plain_state_numel"] for out in results), what


@pytest.mark.parametrize(
    "name,unused",
    [("sgd_momentum", False), ("adam", False), ("adamw", False), ("adamw", True)],
    ids=["sgd_momentum", "adam", "adamw", "adamw-find_unused"],
)
def test_overlapped_sharded_steps_give_the_unsharded_plain_bits_on_2_ranks(name: str, unused: bool) -> None:
    steps = 4
    results = run_distributed(_train_both, 2, args=(name, unused, steps), timeout=120)
    _check_bits(results, name)
    for rank, out in enumerate(results):
        what = f"{name} rank {rank}"
        assert out["warnings"] == [] and out["reasons"] == [], (what, out["warnings"])
        assert out["num_buckets"] >= 3, what
        assert out["stepped"] == steps * out["num_buckets"], (what, out["stepped"])
        # backward waits until the last layer's buckets are back: they step at the next launch, and
        # their parameters start travelling from their owners, while backward goes on
        assert out["in_backward"] >= 1, f"{what}: no bucket stepped during backward"
        assert out["extras"]["optimizer_broadcasts_launched_in_backward"] >= 1, (what, out["extras"])


def test_overlapped_sharded_steps_give_the_unsharded_plain_bits_on_3_ranks() -> None:
    results = run_distributed(_train_both, 3, args=("adamw", False, 3), timeout=180)
    _check_bits(results, "adamw")
    assert all(out["extras"]["optimizer_broadcasts_launched_in_backward"] >= 1 for out in results)


# ---------------------------------------------------------------- fallbacks: the plain sharded step, said once

FALLBACKS = {
    "clip": "gradient clipping by global norm needs every gradient before any parameter steps",
    "unknown": "lockstep does not know that torch.optim.rmsprop.RMSprop steps each parameter",
    "accumulate": "accumulate() scales the averaged gradients into the mean",
    "deterministic": "SyncPolicy(deterministic=True) sums the gradients exactly",
}


@pytest.mark.parametrize("kind", sorted(FALLBACKS))
def test_a_sharded_step_that_cannot_overlap_takes_the_plain_sharded_step_and_says_why_once(kind: str) -> None:
    name = "rmsprop" if kind == "unknown" else "adamw"
    results = run_distributed(_train_both, 2, args=(name, False, 3, kind), timeout=120)
    _check_bits(results, kind)
    for rank, out in enumerate(results):
        what = f"{kind} rank {rank}"
        assert out["stepped"] == 0, f"{what}: the engine stepped {out['stepped']} buckets"
        assert len(out["reasons"]) == 1 and out["reasons"][0].startswith(FALLBACKS[kind]), (what, out)
        assert len(out["warnings"]) == 1, f"{what}: said {len(out['warnings'])} times: {out['warnings']}"
        assert out["warnings"][0].startswith(f"[rank {rank}/2] overlap_optimizer: "), out["warnings"]


# ---------------------------------------------------------------- misuse, the same on every rank


def _second_backward() -> str:
    rank = dist.get_rank()
    net = _Net()
    handle = lockstep.replicate(net, policy=lockstep.SyncPolicy(**TINY_BUCKETS))
    overlapped = handle.overlap_optimizer(handle.shard_optimizer(torch.optim.AdamW(net.parameters())))
    try:
        for _ in range(2):  # a second synced backward before step()
            x, y = small_batch(rank, 0)
            F.cross_entropy(net(x), y).backward()
        overlapped.step()
    except UsageError as error:
        return str(error)
    return "nothing raised"


def test_a_second_synced_backward_before_step_raises_on_every_rank() -> None:
    for rank, said in enumerate(run_distributed(_second_backward, 2, timeout=60)):
        assert said.startswith(f"[rank {rank}/2] a synced backward began before optimizer.step()"), said


def _failed_backward_then_on() -> dict[str, Any]:
    """A backward that raises (a parameter without gradient, find_unused_parameters off) after buckets
    stepped and their broadcasts started; then the loop goes on with every parameter used: the next
    step() raises on every rank, and the steps after it still reach every rank alike (the broadcasts'
    group kept the same sequence on every rank)."""
    rank = dist.get_rank()
    watch = ReductionsStarted()
    net = _Net(watch=watch, spare=True)  # spare unused: the engine reports it at the end of backward
    handle = lockstep.replicate(net, policy=lockstep.SyncPolicy(**TINY_BUCKETS))
    overlapped = handle.overlap_optimizer(handle.shard_optimizer(torch.optim.AdamW(net.parameters())))
    with watch:
        x, y = small_batch(rank, 0)
        try:
            F.cross_entropy(net(x), y).backward()
            raised_in_backward = ""
        except lockstep.errors.UnusedParameterError as error:
            raised_in_backward = type(error).__name__
        try:
            overlapped.step()
            said = "nothing raised"
        except UsageError as error:
            said = str(error)
        net.use_spare = True
        for step in range(2):
            x, y = small_batch(rank, step + 1)
            overlapped.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            overlapped.step()
    return {
        "raised_in_backward": raised_in_backward,
        "said": said,
        "params": [p.detach().clone() for p in net.parameters()],
        "in_backward": handle.stats().extras["optimizer_broadcasts_launched_in_backward"],
    }


def test_a_failed_backward_breaks_the_step_on_every_rank_and_the_broadcasts_stay_in_step() -> None:
    results = run_distributed(_failed_backward_then_on, 2, timeout=60)
    for rank, out in enumerate(results):
        assert out["raised_in_backward"] == "UnusedParameterError", (rank, out["raised_in_backward"])
        assert out["said"].startswith(f"[rank {rank}/2] the previous backward raised after the engine"), out
        assert out["in_backward"] >= 1, out["in_backward"]
        for i, (mine, theirs) in enumerate(zip(out["params"], results[0]["params"])):
            assert torch.equal(mine, theirs), f"rank {rank}: parameter {i} differs from rank 0's"


def _live_mode_shard() -> dict[str, Any]:
    rank = dist.get_rank()
    net = _Net()
    handle = lockstep.replicate(net, policy=lockstep.SyncPolicy(**TINY_BUCKETS))
    from lockstep.engine import ShardedOptimizer

    live = ShardedOptimizer(torch.optim.AdamW(net.parameters()), copies=2, defer_gather=True)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        overlapped = handle.overlap_optimizer(live)
    odd = ShardedOptimizer(torch.optim.AdamW(net.parameters()), copies=2)  # neither fit's live mode nor not
    try:
        handle.overlap_optimizer(odd)
        said = f"rank {rank}: nothing raised"
    except ConfigError as error:
        said = str(error)
    return {"reasons": overlapped.fallback_reasons, "said": said}


def test_a_live_mode_sharded_optimizer_takes_the_plain_step_as_the_plan_says() -> None:
    # The plan's verdict on overlapping in live mode (lockstep/plan.py: it falls back), as fit gives it;
    # before, the engine refused the live-mode ShardedOptimizer that fit takes the plain step with.
    from lockstep.plan import Plan, RunSettings

    rule = Plan.of(RunSettings(overlap_optimizer=True, live=True)).fallback("overlap_optimizer")
    assert rule is not None
    for rank, out in enumerate(run_distributed(_live_mode_shard, 2, timeout=60)):
        assert any(rule.reason in reason for reason in out["reasons"]), out
        said = out["said"]
        assert said.startswith(f"[rank {rank}/2] overlap_optimizer takes the ShardedOptimizer"), said
        assert "copies=2, defer_gather=False" in said and "pass handle.shard_optimizer(optimizer)" in said, (
            said
        )


# ---------------------------------------------------------------- fit with both flags: bits and resume

FIT = {
    "num_samples": 192,
    "batch_size": 8,
    "epochs": 2,
    "optimizer": "adamw",
    "lr_schedule": "cosine",
    "warmup_steps": 3,
    "checkpoint_every": 5,
    "log_every": 4,
}
BOTH = {"overlap_optimizer": True, "shard_optimizer": True}


def _fit(run_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    config = catalog.ToyConfig(run_dir=run_dir, progress="none", **settings)
    built = catalog.build("toy", config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lockstep.fit(built.model, built.train_data, loss_fn=built.loss_fn, config=config)
    return {"summary": result.summary, "history": result.history, "warnings": _warned(caught)}


def _hashes(result: dict[str, Any]) -> tuple[str, str, int]:
    summary = result["summary"]
    return summary["params_sha256"], summary["optimizer_sha256"], summary["steps"]


def _legs(run_dir: Path, legs: list[tuple[dict[str, Any], int | None]]) -> dict[str, Any]:
    for extra, max_steps in legs:
        settings = {**FIT, **extra, "max_steps": max_steps}
        out = run_distributed(_fit, 2, args=(str(run_dir), settings), timeout=300)
    return out[0]


def test_fit_overlapped_and_sharded_gives_the_plain_bits_and_resumes_both_ways(tmp_path: Path) -> None:
    plain = _legs(tmp_path / "plain", [({}, None)])
    both = _legs(tmp_path / "both", [(BOTH, None)])
    assert _hashes(plain)[2] == 2 * 192 // 16
    assert _hashes(both) == _hashes(plain)
    assert both["history"] == plain["history"] and both["warnings"] == []
    verdict = compare_checkpoints(tmp_path / "plain", tmp_path / "both")
    assert verdict.equal, verdict.describe()
    # a checkpoint of the overlapped sharded run resumes into a plain unsharded one, and the reverse, with
    # the bits of the plain run resumed at the same step (the default mode's float run, resumed mid-epoch,
    # is compared with a resumed run: its bits are the same only at the same cut)
    reference = _legs(tmp_path / "plain_resumed", [({}, 7), ({}, None)])
    for name, legs in (("into_plain", [(BOTH, 7), ({}, None)]), ("from_plain", [({}, 7), (BOTH, None)])):
        resumed = _legs(tmp_path / name, legs)
        assert resumed["summary"]["steps_this_run"] == _hashes(plain)[2] - 7, name
        assert _hashes(resumed) == _hashes(reference), name
        verdict = compare_checkpoints(tmp_path / "plain_resumed", tmp_path / name)
        assert verdict.equal, (name, verdict.describe())


def test_fit_with_a_bucket_size_overlapped_and_sharded_gives_the_plain_bits(tmp_path: Path) -> None:
    # bucket_cap_mb set: fit replicates the module through the handle (trainer/run/buckets.py), not the drop-in
    sized = {"bucket_cap_mb": 0.001}
    plain = _legs(tmp_path / "plain", [(sized, None)])
    both = _legs(tmp_path / "both", [({**sized, **BOTH}, None)])
    assert _hashes(both) == _hashes(plain) and both["warnings"] == []
    verdict = compare_checkpoints(tmp_path / "plain", tmp_path / "both")
    assert verdict.equal, verdict.describe()


DETERMINISTIC = {"num_samples": 256, "global_batch_size": 24, "micro_batch_size": 4, "epochs": 2}


def _deterministic_legs(run_dir: str, legs: list[tuple[int, bool, int | None]]) -> dict[str, Any]:
    for world, both, max_steps in legs:
        settings = {**DETERMINISTIC, "deterministic": True, "max_steps": max_steps, **(BOTH if both else {})}
        out = run_distributed(_fit, world, args=(run_dir, settings), timeout=300)
    return out[0]


def test_fit_overlapped_and_sharded_resumes_exactly_at_another_world_size(tmp_path: Path) -> None:
    # deterministic mode: the same bits at any world size; the overlap falls back (said once), sharding holds
    whole = _deterministic_legs(str(tmp_path / "whole"), [(1, False, None)])
    resumed = _deterministic_legs(str(tmp_path / "resumed"), [(2, True, 5), (1, False, 13), (2, True, None)])
    assert resumed["summary"]["steps_this_run"] < whole["summary"]["steps"]
    assert _hashes(resumed) == _hashes(whole)
    assert len(resumed["warnings"]) == 1 and "accumulate()" in resumed["warnings"][0], resumed["warnings"]
    verdict = compare_checkpoints(tmp_path / "whole", tmp_path / "resumed")
    assert verdict.equal, verdict.describe()
