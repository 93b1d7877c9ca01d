"""Graph shapes (issue 3 item 7): tied weights, activation checkpointing, static_graph."""

from __future__ import annotations

import pytest

from lockstep.errors import DistributedTestError
from lockstep.testing import run_distributed
from lockstep.testing.parity import assert_parity, run_parity, train_cases, train_single
from tests.helpers import case

STEPS = 3


def test_tied_weights_and_checkpointing() -> None:
    names = ["tied", "ckpt_reentrant", "ckpt_plain"]
    run_parity({name: case(name, STEPS) for name in names}, 2)


def test_a_layer_checkpointed_twice_before_its_bucket_is_full() -> None:
    # Block 0 runs in two reentrant checkpoints: its hooks fire twice per backward, the second time
    # before its bucket is full (after the first step they are fast hooks, whose second report must not
    # count as another parameter). torch's DDP refuses this ("Expected to mark a variable ready only
    # once"); lockstep sums it right, checked against one process on the concatenated batch.
    twice = case("ckpt_twice", 4)
    runs = run_distributed(train_cases, 2, args=({"twice": twice}, ("ours",), None), timeout=90)
    assert_parity([rank["twice"] for rank in runs], train_single(twice, 2), reference="ours", what="twice")


def test_a_layer_checkpointed_twice_after_its_bucket_was_reduced_raises_on_every_rank() -> None:
    # Small buckets: block 0's bucket is reduced before its second gradient arrives (torch's error).
    twice = case("ckpt_twice", 4, ddp_kwargs={"bucket_cap_mb": 0.002})
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(train_cases, 2, args=({"twice": twice}, ("ours",), None), timeout=90)
    for rank in (0, 1):
        assert (
            f"GradientError: [rank {rank}/2] Expected to mark a variable ready only once. Parameter 'blocks.0."
            in str(caught.value)
        )


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
