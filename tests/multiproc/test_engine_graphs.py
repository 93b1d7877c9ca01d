"""Graph shapes (issue 3 item 7): tied weights, activation checkpointing, static_graph."""

from __future__ import annotations

import pytest

from lockstep.testing import run_distributed
from tests.multiproc.engine_util import assert_close_lists, train, train_single

STEPS = 3


def _models(names: list[str], kwargs: dict) -> dict:
    return {
        name: {kind: train(kind, name, STEPS, kwargs=kwargs) for kind in ("ours", "replicate", "torch")}
        for name in names
    }


def _check(out: list[dict], names: list[str], *, single: bool = True) -> None:
    for name in names:
        ref = train_single(name, 2, STEPS) if single else None
        for rank, by_name in enumerate(out):
            by_kind = by_name[name]
            for kind in ("ours", "replicate"):
                for step in range(STEPS):
                    assert_close_lists(by_kind[kind]["grads"][step], by_kind["torch"]["grads"][step],
                                       what=f"{name} rank {rank} {kind} step {step}")
                assert_close_lists(by_kind[kind]["params"], by_kind["torch"]["params"], what=f"{name} {kind}")
                if ref is not None:
                    assert_close_lists(by_kind[kind]["params"], ref["params"], what=f"{name} {kind} vs single")


def test_tied_weights_and_checkpointing() -> None:
    names = ["tied", "ckpt_reentrant", "ckpt_plain"]
    _check(run_distributed(_models, 2, args=(names, {}), timeout=90), names)


@pytest.mark.parametrize("kwargs", [
    {"static_graph": True, "bucket_cap_mb": 0.001},  # several buckets: launches counted per parameter
    {"static_graph": True, "find_unused_parameters": True},
])
def test_static_graph(kwargs: dict) -> None:
    # ckpt_shared: a parameter used in two reentrant checkpoints, its hook fires twice per backward
    names = ["mlp", "unused", "ckpt_shared"]
    _check(run_distributed(_models, 2, args=(names, kwargs), timeout=90), names)
