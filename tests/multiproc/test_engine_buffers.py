"""Buffers (issue 3 item 5): BatchNorm running stats broadcast from rank 0 before each training forward."""

from __future__ import annotations

import pytest

from lockstep.testing import run_distributed
from tests.multiproc.engine_util import assert_close_lists, train

STEPS = 3


def _bn(broadcast: bool) -> dict:
    kw = {"broadcast_buffers": broadcast}
    return {kind: train(kind, "convbn", STEPS, kwargs=kw) for kind in ("ours", "replicate", "torch")}


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_torch(broadcast: bool) -> None:
    out = run_distributed(_bn, 2, args=(broadcast,), timeout=90)
    for rank, by_kind in enumerate(out):
        for kind in ("ours", "replicate"):
            assert_close_lists(by_kind[kind]["buffers"], by_kind["torch"]["buffers"], what=f"rank {rank} {kind} buffers")
            assert_close_lists(by_kind[kind]["params"], by_kind["torch"]["params"], what=f"rank {rank} {kind} params")
    # each rank's stats = rank 0's before the last forward, updated with its own batch: they differ
    mean0, mean1 = out[0]["ours"]["buffers"][0], out[1]["ours"]["buffers"][0]
    assert (mean0 - mean1).abs().max() > 1e-4
