"""Buffers (issue 3 item 5): BatchNorm running stats broadcast from rank 0 before each training forward."""

from __future__ import annotations

import pytest

from lockstep.testing.parity import run_parity
from tests.multiproc.engine_util import case

STEPS = 3


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_torch(broadcast: bool) -> None:
    # BatchNorm's statistics are per rank: no single-process reference, torch's DDP is the oracle
    bn = case("convbn", STEPS, ddp_kwargs={"broadcast_buffers": broadcast}, single_process=False)
    out = run_parity({"convbn": bn}, 2)["convbn"]
    # each rank's stats = rank 0's before the last forward, updated with its own batch: they differ
    mean0, mean1 = out[0]["ours"].buffers[0], out[1]["ours"].buffers[0]
    assert (mean0 - mean1).abs().max() > 1e-4
