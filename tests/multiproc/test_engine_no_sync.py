"""no_sync (issue 3 item 4): no communication inside; the next synced backward reduces the sum."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F

import lockstep
from lockstep.testing import run_distributed
from lockstep.testing.parity import run_parity
from tests.helpers import batch, build, case

STEPS = 6  # 3 synced steps of 2 micro-batches


def _synced_steps() -> dict:
    # no bytes move inside no_sync: only the synced backwards count
    out = {}
    module = build("mlp", 0)
    handle = lockstep.replicate(module)
    for step in range(4):
        x, y = batch(dist.get_rank(), step)
        with handle.no_sync():
            F.cross_entropy(module(x), y).backward()
    out["synced_after_no_sync"] = handle.stats().synced_steps
    F.cross_entropy(module(x), y).backward()
    out["synced_after_one"] = handle.stats().synced_steps
    return out


def test_no_sync_accumulates_then_reduces_the_sum() -> None:
    # every synced step's gradients against torch's DDP and one process on the whole accumulated batch
    out = run_parity({"mlp": case("mlp", STEPS, no_sync_every=2)}, 2)["mlp"]
    for by_kind in out:
        assert [len(run.grads) for run in by_kind.values()] == [3, 3, 3]
    for counts in run_distributed(_synced_steps, 2, timeout=60):
        assert counts["synced_after_no_sync"] == 0 and counts["synced_after_one"] == 1
