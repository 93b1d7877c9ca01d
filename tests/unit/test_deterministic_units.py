"""Deterministic mode's pure parts: the batch plan, the micro-batch sampler, the fixed-point scale, compare."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lockstep.checkpoint.compare import compare_states, state_sha256
from lockstep.data import MicroBatchSampler
from lockstep.engine.deterministic import fixed_point
from lockstep.engine.deterministic.fixed_point import (
    EXACT_BITS,
    HEADROOM_BITS,
    powers_of_two,
    scale_exponents,
)
from lockstep.errors import ConfigError
from lockstep.runtime.micro_batches import micro_batch_seed, owned_micro_batches
from lockstep.trainer.live.live_side import live_batch_plan
from lockstep.trainer.run.batches import BatchPlan, plan_batches
from lockstep.trainer.settings.config import FitConfig, plan_of


@dataclass
class Settings:
    batch_size: int = 32
    grad_accum_steps: int = 1
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    deterministic: bool = False


def test_the_plan_keeps_the_old_meaning_without_a_global_batch() -> None:
    assert plan_batches(Settings(batch_size=8, grad_accum_steps=3), 2) == BatchPlan(48, 8, 3, 0)


def test_a_global_batch_is_split_over_ranks_and_micro_batches() -> None:
    assert plan_batches(Settings(global_batch_size=48), 3) == BatchPlan(48, 16, 1, 0)
    assert plan_batches(Settings(global_batch_size=48, micro_batch_size=8), 3) == BatchPlan(48, 8, 2, 0)
    with pytest.raises(ConfigError, match="does not split evenly over 5 ranks"):
        plan_batches(Settings(global_batch_size=48), 5)


def test_deterministic_micro_batches_do_not_depend_on_the_world_size() -> None:
    plans = {
        plan_batches(Settings(global_batch_size=48, micro_batch_size=8, deterministic=True), w)
        for w in (1, 3, 5)
    }
    assert plans == {BatchPlan(48, 8, 0, 6)}
    # fit's door refuses deterministic mode without a global batch (the plan's check, lockstep/plan.py)
    with pytest.raises(ConfigError, match="deterministic=True without global_batch_size: the same bits"):
        plan_of(FitConfig(deterministic=True), 2, live=False)
    with pytest.raises(ConfigError, match="not a multiple of the micro-batch size 32"):
        plan_batches(Settings(global_batch_size=48, deterministic=True), 2)


def test_live_mode_cuts_micro_batches_without_deterministic_mode_too() -> None:
    # The global batch defaults to the per-rank batch on every launched rank, at any current world size.
    assert {live_batch_plan(Settings(batch_size=8, grad_accum_steps=2), w, 4) for w in (4, 3, 1)} == {
        BatchPlan(64, 8, 0, 8)
    }
    assert live_batch_plan(Settings(global_batch_size=24, micro_batch_size=4), 3, 4) == BatchPlan(24, 4, 0, 6)
    # fit's door (the plan, on the launched ranks) refuses a cut that leaves a rank without a micro-batch
    with pytest.raises(ConfigError, match="on 4 ranks, 2 micro-batches of 12 in a step of 24 samples"):
        plan_of(FitConfig(global_batch_size=24, micro_batch_size=12), 4, live=True)
    # deterministic mode keeps its own rules (an explicit global batch)
    assert live_batch_plan(Settings(global_batch_size=24, micro_batch_size=12, deterministic=True), 3, 4) == (
        BatchPlan(24, 12, 0, 2)
    )
    with pytest.raises(ConfigError, match="deterministic=True without global_batch_size"):
        plan_of(FitConfig(deterministic=True), 2, live=True)


def test_owners_are_round_robin_and_seeds_ignore_the_rank() -> None:
    assert [owned_micro_batches(5, 2, r) for r in (0, 1)] == [[0, 2, 4], [1, 3]]
    assert owned_micro_batches(2, 4, 3) == []
    assert micro_batch_seed(0, 3, 1) == micro_batch_seed(0, 3, 1) != micro_batch_seed(0, 3, 2)


def _sampled(world: int, **kw: object) -> list[list[int]]:
    """Every rank's micro-batches, put back in ordinal order per step."""
    per_rank = [
        list(MicroBatchSampler(range(50), 4, 3, num_replicas=world, rank=r, **kw)) for r in range(world)
    ]  # type: ignore[arg-type]
    steps = len(per_rank[0]) // len(owned_micro_batches(3, world, 0))
    out = []
    for step in range(steps):
        for k in range(3):
            r = k % world
            out.append(per_rank[r][step * len(owned_micro_batches(3, world, r)) + k // world])
    return out


def test_the_sampler_cuts_the_same_micro_batches_at_every_world_size() -> None:
    one = _sampled(1, seed=5)
    assert len(one) == 4 * 3 and all(len(b) == 4 for b in one)  # 50 // 12 = 4 whole steps
    assert _sampled(2, seed=5) == _sampled(3, seed=5) == one
    assert len({i for b in one for i in b}) == 48


def test_the_sampler_resumes_mid_epoch_at_another_world_size() -> None:
    first = MicroBatchSampler(range(50), 4, 3, num_replicas=2, rank=0, seed=1)  # type: ignore[arg-type]
    iter(first)
    first.advance(12)
    state = first.state_dict()
    assert state["num_consumed"] == 12 and state["epoch"] == 0
    later = MicroBatchSampler(range(50), 4, 3, num_replicas=3, rank=1, seed=1)  # type: ignore[arg-type]
    later.load_state_dict(state)
    later.set_epoch(0)
    assert later.num_steps() == 3
    whole = MicroBatchSampler(range(50), 4, 3, num_replicas=3, rank=1, seed=1)  # type: ignore[arg-type]
    assert list(later) == list(whole)[1:]


def test_an_evaluation_split_keeps_its_short_last_block() -> None:
    blocks = MicroBatchSampler(range(10), 4, 3, num_replicas=2, rank=0, shuffle=False, drop_last=False)  # type: ignore[arg-type]
    assert list(blocks) == [[0, 1, 2, 3], [8, 9]]


def on_grid(grad: torch.Tensor, multiplier: float) -> torch.Tensor:
    """The grid's definition, which the kernels must match bit for bit: round(grad * 2**s) in float64."""
    return torch.round(grad.double() * multiplier)


def test_the_scale_leaves_room_for_the_headroom_and_the_sum() -> None:
    maxima = torch.tensor([0.75, 3.0, 0.0, float("inf")])
    shifts = scale_exponents(maxima, 8, HEADROOM_BITS).tolist()
    top = EXACT_BITS - HEADROOM_BITS - 3
    assert shifts == [top - 0, top - 2, top - 2, top - 2]  # 0.75 < 2**0, 3 < 2**2; the others borrow
    grad = torch.tensor([0.75, -0.75 * 2**-30, 1e-30])
    rounded = on_grid(grad, 2.0 ** shifts[0])
    assert rounded[0] == 0.75 * 2 ** shifts[0] and rounded[2] == 0
    assert abs(float(rounded[0])) * 8 * 2**HEADROOM_BITS <= 2**EXACT_BITS


def test_compare_and_hash_see_every_bit() -> None:
    a = {"w": torch.tensor([0.0, 1.0]), "opt": {"step": 3, "m": [torch.ones(2)]}}
    b = {"w": torch.tensor([-0.0, 1.0]), "opt": {"step": 3, "m": [torch.ones(2)]}}
    assert compare_states(a, a).equal and state_sha256(a) == state_sha256({**a})
    verdict = compare_states(a, b)
    assert not verdict.equal and verdict.path == "w" and state_sha256(a) != state_sha256(b)
    c = {"w": torch.tensor([0.0, 1.0]), "opt": {"step": 4, "m": [torch.ones(2)]}}
    assert compare_states(a, c).path == "opt.step"


def test_powers_of_two_are_exact_over_the_shift_range() -> None:
    exponents = torch.arange(-1000, 1001)
    values = powers_of_two(exponents).tolist()
    assert values == [math.ldexp(1.0, e) for e in range(-1000, 1001)]


def test_the_quantizer_adds_exactly_across_its_pieces_and_measures_the_largest(monkeypatch: Any) -> None:
    monkeypatch.setattr(fixed_point, "CHUNK_ELEMENTS", 7)  # pieces that do not divide the tensor
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(5, 6, generator=g) * 10.0**i for i in range(3)]
    quantizer, acc, mult = fixed_point.Quantizer(), torch.empty(30, dtype=torch.float64), 2.0**40
    largest = [quantizer.add(acc, [grad], mult, first=i == 0) for i, grad in enumerate(grads)]
    expected = sum(on_grid(grad.reshape(-1), mult) for grad in grads)
    assert torch.equal(acc, expected)
    assert [float(x) for x in largest] == [float(grad.abs().max()) for grad in grads]
    assert torch.isnan(
        quantizer.add(
            torch.empty(2, dtype=torch.float64), [torch.tensor([1.0, float("nan")])], mult, first=True
        )
    )
    together = torch.empty(30, dtype=torch.float64)  # two gradients in one pass, then a third
    assert float(quantizer.add(together, grads[:2], mult, first=True)) == float(grads[1].abs().max())
    quantizer.add(together, grads[2:], mult, first=False)
    assert torch.equal(together, expected)
    out = torch.empty(5, 6)
    factor = 2.0**-40 / 3
    quantizer.write_mean(out, acc.clone(), factor)
    assert torch.equal(out, (expected * factor).to(torch.float32).view(5, 6))
