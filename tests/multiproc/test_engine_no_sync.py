"""no_sync (issue 3 item 4): no communication inside; the next synced backward reduces the sum."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F

import lockstep
from lockstep.testing import run_distributed
from tests.multiproc.engine_util import assert_close_lists, batch, build, train, train_single

STEPS = 6  # 3 synced steps of 2 micro-batches


def _accumulate() -> dict:
    out = {kind: train(kind, "mlp", STEPS, no_sync_every=2) for kind in ("ours", "replicate", "torch")}
    # no bytes move inside no_sync: only the synced backwards count
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
    out = run_distributed(_accumulate, 2, timeout=90)
    single = train_single("mlp", 2, STEPS, no_sync_every=2)
    for by_kind in out:
        for kind in ("ours", "replicate"):
            assert len(by_kind[kind]["grads"]) == 3
            for step in range(3):
                assert_close_lists(by_kind[kind]["grads"][step], by_kind["torch"]["grads"][step], what=f"{kind} {step}")
                assert_close_lists(by_kind[kind]["grads"][step], single["grads"][step], what=f"{kind} single {step}")
            assert_close_lists(by_kind[kind]["params"], single["params"], what=f"{kind} params")
        assert by_kind["synced_after_no_sync"] == 0 and by_kind["synced_after_one"] == 1
