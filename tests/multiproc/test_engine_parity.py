"""Gradient averaging: lockstep vs torch's DDP vs one process on the concatenated batch (issue 3 item 3)."""

from __future__ import annotations

import pytest

from lockstep.testing import run_distributed
from tests.multiproc.engine_util import assert_close_lists, train, train_single

STEPS = 4


def _three_ways(name: str, kwargs: dict) -> dict:
    return {kind: train(kind, name, STEPS, kwargs=kwargs) for kind in ("ours", "replicate", "torch")}


@pytest.mark.parametrize(
    ("name", "kwargs", "world"),
    [
        ("mlp", {}, 2),
        ("mlp", {"gradient_as_bucket_view": True}, 3),
        # a tiny cap: many buckets, bulk copy-in buckets, the rebuild after the first step
        ("many_small", {"bucket_cap_mb": 0.0005}, 2),
    ],
)
def test_grads_and_params_match_torch_and_single_process(name: str, kwargs: dict, world: int) -> None:
    out = run_distributed(_three_ways, world, args=(name, kwargs), timeout=90)
    single = train_single(name, world, STEPS)
    for rank, by_kind in enumerate(out):
        for kind in ("ours", "replicate"):
            for step in range(STEPS):
                assert_close_lists(by_kind[kind]["grads"][step], by_kind["torch"]["grads"][step],
                                   what=f"rank {rank} {kind} vs torch grads step {step}")
                assert_close_lists(by_kind[kind]["grads"][step], single["grads"][step],
                                   what=f"rank {rank} {kind} vs single grads step {step}")
            assert_close_lists(by_kind[kind]["params"], by_kind["torch"]["params"], what=f"{kind} params")
            assert_close_lists(by_kind[kind]["params"], single["params"], what=f"{kind} vs single params")
    # replicas stay identical bit for bit
    for rank in range(1, world):
        assert_close_lists(out[rank]["ours"]["params"], out[0]["ours"]["params"], atol=0, rtol=0, what="replicas")


def _solo(threshold: int) -> dict:
    # gradients above the threshold are reduced in place in buckets of their own (no flat buffer)
    import lockstep.engine.reducer as reducer

    reducer.SOLO_BUCKET_BYTES = threshold
    out = {kind: train(kind, "mlp", STEPS) for kind in ("ours", "torch")}
    out.update({f"unused {kind}": train(kind, "unused", STEPS, kwargs={"find_unused_parameters": True})
                for kind in ("ours", "torch")})
    out.update({f"no_sync {kind}": train(kind, "mlp", 4, no_sync_every=2) for kind in ("ours", "torch")})
    return out


def test_solo_buckets_reduce_gradients_in_place() -> None:
    for by_kind in run_distributed(_solo, 2, args=(256,), timeout=90):
        for prefix in ("", "unused ", "no_sync "):
            ours, theirs = by_kind[f"{prefix}ours"], by_kind[f"{prefix}torch"]
            for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
                assert_close_lists(a, b, what=f"{prefix}step {step}")
            assert_close_lists(ours["params"], theirs["params"], what=f"{prefix}params")
