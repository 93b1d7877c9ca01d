"""Graph shapes (issue 3 item 7): tied weights, activation checkpointing, static_graph."""

from __future__ import annotations

import pytest

from lockstep.testing.parity import run_parity
from tests.multiproc.engine_util import case

STEPS = 3


def test_tied_weights_and_checkpointing() -> None:
    names = ["tied", "ckpt_reentrant", "ckpt_plain"]
    run_parity({name: case(name, STEPS) for name in names}, 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"static_graph": True, "bucket_cap_mb": 0.001},  # several buckets: launches counted per parameter
        {"static_graph": True, "find_unused_parameters": True},
    ],
)
def test_static_graph(kwargs: dict) -> None:
    # ckpt_shared: a parameter used in two reentrant checkpoints, its hook fires twice per backward
    names = ["mlp", "unused", "ckpt_shared"]
    run_parity({name: case(name, STEPS, ddp_kwargs=kwargs) for name in names}, 2)
