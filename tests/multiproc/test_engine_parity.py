"""Gradient averaging: lockstep vs torch's DDP vs one process on the concatenated batch (issue 3 item 3)."""

from __future__ import annotations

import pytest

import lockstep.engine.buckets.reducer as reducer
from lockstep.testing.parity import run_parity
from tests.helpers import case

STEPS = 4


@pytest.mark.parametrize(
    ("name", "kwargs", "world"),
    [
        ("mlp", {}, 2),
        ("mlp", {"gradient_as_bucket_view": True}, 3),  # 3 ranks: slow by the rule of tests/conftest.py
        # a tiny cap: many buckets, bulk copy-in buckets, the rebuild after the first step
        ("many_small", {"bucket_cap_mb": 0.0005}, 2),
    ],
)
def test_grads_and_params_match_torch_and_single_process(name: str, kwargs: dict, world: int) -> None:
    # run_parity checks every synced step's gradients and the final parameters of the drop-in class and
    # `replicate` against torch's DDP (bitwise where the sums allow) and one process, replicas bitwise.
    out = run_parity({name: case(name, STEPS, ddp_kwargs=kwargs)}, world)
    assert len(out[name]) == world and all(len(by_kind["ours"].grads) == STEPS for by_kind in out[name])


def _small_solo_buckets() -> None:
    # gradients above this threshold are reduced in place in buckets of their own (no flat buffer);
    # only lockstep's own layout (`replicate`) has solo buckets: the drop-in class takes torch's layout
    reducer.SOLO_BUCKET_BYTES = 256


def test_solo_buckets_reduce_gradients_in_place() -> None:
    cases = {
        "mlp": case("mlp", STEPS),
        "unused": case("unused", STEPS, ddp_kwargs={"find_unused_parameters": True}),
        "no_sync": case("mlp", 4, no_sync_every=2),
    }
    run_parity(cases, 2, setup=_small_solo_buckets)
