"""A periodic sync across sharded replica groups (ShardPolicy.sync): FSDP2 inside each group, the groups
meeting every H steps on their shards.

The oracle is the replicated engine's periodic sync (itself checked against a plain reference in
test_outer_sync.py) with one rank per group, training on the concatenation of its group's batches: 4 ranks
as 2 groups of FSDP 2 end with its parameters up to rounding (FSDP2's reduce-scatter averages two halves of
the batch where the replicated rank takes the whole), and the groups end a round with equal bits. What
crosses the groups is the outer sync's payload alone; what FSDP2 sends inside a group is counted apart.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine import replicate
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.sharded import ShardPolicy, full_tensors, shard
from lockstep.errors import ConfigError, NotSupportedError
from lockstep.jobs.models import TinyGPT
from lockstep.testing import run_distributed

TIMEOUT = 240
VOCAB = 29
STEPS = 6
EVERY = 3
DEGREE = 2  # 4 ranks: 2 groups of 2


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, context=16, dim=32, depth=3, heads=4)


def _batches() -> list[list[torch.Tensor]]:
    """Step s, rank r of 4: its batch of 2 sequences."""
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, VOCAB, (2, 17), generator=g) for _ in range(4)] for _ in range(STEPS)]


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch[:, :-1])
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def _policy(sync: str) -> SyncPolicy:
    """`streaming_diloco`: 2 fragments (each block of rows inside one shard); `streaming_diloco/3`: 3 (a
    block's rows straddle the two shards: each rank sends its share of it)."""
    sync, _, count = sync.partition("/")
    fragments = int(count or 2) if sync == "streaming_diloco" else 1
    return SyncPolicy(sync=sync, sync_every=EVERY, outer_lr=0.7, outer_momentum=0.9, fragments=fragments)


def _train(model: nn.Module, handle: Any, batch_of: Any) -> list[bool]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    synced = []
    for step in range(STEPS):
        _loss(model, batch_of(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        synced.append(handle.after_optimizer_step())
    handle.flush_sync()
    return synced


def _sharded(sync: str) -> dict[str, Any]:
    model = _gpt()
    handle = shard(model, ShardPolicy(shard_degree=DEGREE, sync=_policy(sync)))
    batches, rank = _batches(), dist.get_rank()
    synced = _train(model, handle, lambda step: batches[step][rank])
    state = {k: v.detach().clone() for k, v in full_tensors(model.state_dict()).items()}  # this group's
    extras = handle.stats().extras
    return {
        "state": state,
        "synced": synced,
        "extras": extras,
        "outer": handle.sync_state_dict()["inner_steps"],
    }


def _replicated(sync: str) -> dict[str, Any]:
    model = _gpt()
    handle = replicate(model, policy=_policy(sync))
    batches, rank = _batches(), dist.get_rank()
    synced = _train(model, handle, lambda step: torch.cat(batches[step][DEGREE * rank : DEGREE * (rank + 1)]))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "synced": synced, "extras": handle.stats().extras}


@pytest.mark.parametrize("sync", ["local_sgd", "diloco", "streaming_diloco", "streaming_diloco/3"])
def test_sharded_groups_meeting_every_h_steps_match_the_replicated_sync(sync: str) -> None:
    reference = run_distributed(_replicated, 2, args=(sync,), timeout=TIMEOUT)
    ranks = run_distributed(_sharded, 4, args=(sync,), timeout=TIMEOUT)
    for rank, out in enumerate(ranks):
        group = rank // DEGREE
        assert out["synced"] == reference[group]["synced"], (rank, out["synced"])
        for name, value in reference[group]["state"].items():
            torch.testing.assert_close(
                out["state"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}"
            )
    if not sync.startswith("streaming"):  # the last step ended a round: every group holds the same bits
        for name, value in ranks[0]["state"].items():
            assert torch.equal(value, ranks[DEGREE]["state"][name]), name
    # Between the groups: the outer sync alone, each rank its shard (half the replicated rank's payload)
    between = [out["extras"]["bytes_communicated_total"] for out in ranks]
    assert sum(between) == sum(r["extras"]["bytes_communicated_total"] for r in reference), between
    assert all(out["extras"]["bytes_in_group"] > 0 for out in ranks)
    assert [out["extras"]["inner_steps"] for out in ranks] == [STEPS] * 4


def _hsdp_bytes() -> dict[str, int]:
    model = _gpt()
    handle = shard(model, ShardPolicy(shard_degree=DEGREE))
    batches, rank = _batches(), dist.get_rank()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(STEPS):
        _loss(model, batches[step][rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
    extras = handle.stats().extras
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    return {
        "between": extras["bytes_communicated_total"],
        "in_group": extras["bytes_in_group"],
        "local": local,
    }


def test_hsdp_counts_its_all_reduce_between_groups_and_diloco_sends_h_times_less() -> None:
    """FSDP2's HSDP all-reduces each rank's gradient shard across the groups every step (its padded shard:
    at least the local shard); DiLoCo sends that shard once per round."""
    hsdp = run_distributed(_hsdp_bytes, 4, timeout=TIMEOUT)
    diloco = run_distributed(_sharded, 4, args=("diloco",), timeout=TIMEOUT)
    for every_step, periodic in zip(hsdp, diloco):
        assert every_step["between"] >= STEPS * every_step["local"], every_step
        assert periodic["extras"]["bytes_communicated_total"] == (STEPS // EVERY) * every_step["local"]
        assert every_step["between"] >= EVERY * periodic["extras"]["bytes_communicated_total"]


def _refused(degree: int, deterministic: bool) -> str:
    try:
        shard(_gpt(), ShardPolicy(shard_degree=degree, deterministic=deterministic, sync=_policy("diloco")))
    except (ConfigError, NotSupportedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def test_a_periodic_sync_without_two_groups_or_in_deterministic_mode_is_refused_on_every_rank() -> None:
    one_group = run_distributed(_refused, 2, args=(2, False), timeout=TIMEOUT)
    assert all(r.startswith("ConfigError") and "one replica group has no other" in r for r in one_group), (
        one_group
    )
    exact = run_distributed(_refused, 4, args=(2, True), timeout=TIMEOUT)
    assert all(r.startswith("NotSupportedError") and "deterministic" in r for r in exact), exact


def _batchnorm_buffers() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    handle = shard(model, ShardPolicy(shard_degree=DEGREE, sync=SyncPolicy(sync="diloco", sync_every=2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        model(torch.randn(6, 8, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.after_optimizer_step()
    return {name: b.clone() for name, b in model.named_buffers() if b.is_floating_point()}


def test_at_a_rounds_end_every_rank_holds_the_same_batchnorm_statistics() -> None:
    """Each rank's running statistics differ (its own data); at the round's end their mean over the groups is
    every rank's, inside a group too (an evaluation or a checkpoint then sees one model)."""
    ranks = run_distributed(_batchnorm_buffers, 4, timeout=TIMEOUT)
    for rank, buffers in enumerate(ranks[1:], start=1):
        for name, value in ranks[0].items():
            assert torch.equal(buffers[name], value), f"rank {rank}: {name}"
