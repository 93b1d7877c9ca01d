"""lockstep.testing.parity's comparison: what it accepts and what it must catch (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from lockstep.errors import ConfigError, ParityError
from lockstep.testing.parity import ParityCase, ParityRun, assert_parity, exact_kinds, train_single


def _run(scale: float = 1.0, grad_none: bool = False) -> ParityRun:
    grad = None if grad_none else torch.tensor([0.5, -1.0]) * scale
    return ParityRun(
        grads=[[torch.tensor([1.0, 2.0]) * scale, grad]],
        params=[torch.tensor([3.0]) * scale],
        buffers=[torch.tensor([4.0])],
    )


def test_equal_runs_pass_and_bitwise_kinds_follow_the_world_size() -> None:
    assert_parity([{"ours": _run(), "replicate": _run(), "torch": _run()}] * 2, _run())
    assert exact_kinds(2) == ("ours", "replicate") and exact_kinds(3) == ("ours",)


def test_one_ulp_fails_a_bitwise_kind_and_passes_a_tolerant_one() -> None:
    off = _run(1.0 + 2**-23)
    assert_parity([{"replicate": off, "torch": _run()}], exact=("ours",))
    with pytest.raises(
        ParityError, match=r"\[rank 0/1\] ours vs torch grads step 0\[0\] \(atol=0.0, rtol=0.0\)"
    ):
        assert_parity([{"ours": off, "torch": _run()}], exact=("ours",), what="mlp")


def test_a_real_difference_fails_against_torch_and_against_one_process() -> None:
    with pytest.raises(ParityError, match="replicate vs torch grads step 0"):
        assert_parity([{"replicate": _run(1.01), "torch": _run()}], exact=())
    with pytest.raises(ParityError, match="ours vs one process grads step 0"):
        assert_parity([{"ours": _run(1.01), "torch": _run(1.01)}], _run())


def test_a_missing_gradient_or_diverging_replicas_fail() -> None:
    with pytest.raises(ParityError, match=r"grads step 0\[1\]: None, expected a tensor"):
        assert_parity([{"ours": _run(grad_none=True), "torch": _run()}])
    diverged = [{"ours": _run(), "torch": _run()}, {"ours": _run(1.5), "torch": _run(1.5)}]
    with pytest.raises(ParityError, match="ours replicas: rank 1 vs rank 0 params"):
        assert_parity(diverged)


def test_a_per_rank_case_has_no_single_process_reference() -> None:
    case = ParityCase(
        model=lambda seed: torch.nn.Linear(2, 2),
        data=lambda r, s: (torch.ones(1, 2), torch.zeros(1)),
        steps=1,
        single_process=False,
    )
    with pytest.raises(ConfigError, match="no single-process reference"):
        train_single(case, 2)
