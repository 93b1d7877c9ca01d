"""Deterministic mode at the engine level: the same bits at world sizes 1-4, and the right numbers.

The model has what makes bits depend on the world size in the default mode: BatchNorm (statistics and
running buffers), SyncBatchNorm (statistics shared across ranks), dropout (random masks), a weight used
twice, a large weight (taken in its hook) and many small ones (taken together), under AdamW. Each run
trains STEPS steps of a global batch of K micro-batches through handle.accumulate() and returns the
sha256 of parameters, buffers and optimizer state; the oracle for the numbers is one process running
the same micro-batches in order with float accumulation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.errors import ConfigError, NotSupportedError, UsageError
from lockstep.runtime.micro_batches import micro_batch_seed
from lockstep.testing import run_distributed
from tests.helpers import DET_K as K
from tests.helpers import DET_STEPS as STEPS
from tests.helpers import DetNet, det_data, det_micro, state_digest

TIMEOUT = 120


def _model() -> tuple[DetNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DetNet()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_deterministic(steps: int = STEPS) -> dict[str, Any]:
    model, optimizer = _model()
    handle = lockstep.replicate(model, policy=lockstep.SyncPolicy(deterministic=True))
    data = det_data()
    losses = []

    def micro_step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        return float(loss.detach())

    for step in range(steps):
        mine = {k: det_micro(data, step, k) for k in handle.owned_micro_batches(K)}
        results = handle.accumulate(micro_step, mine, num_micro_batches=K, step=step, seed=3)
        losses.append(results)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "digest": state_digest(model, optimizer),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "stats": handle.stats().extras,
    }


def _train_default() -> str:
    """The default engine with the same global batch: K/W micro-batches per rank, no_sync accumulation."""
    model, optimizer = _model()
    model = lockstep.DistributedDataParallel(model)
    data = det_data()
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        mine = list(range(rank, K, world))
        for index, k in enumerate(mine):
            x, y = det_micro(data, step, k)
            with model.no_sync() if index < len(mine) - 1 else torch.enable_grad():
                (nn.functional.cross_entropy(model(x), y) * world / K).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return state_digest(model.module, optimizer)


@pytest.fixture(scope="module")
def deterministic_runs() -> dict[int, list[dict[str, Any]]]:
    return {world: run_distributed(_train_deterministic, world, timeout=TIMEOUT) for world in (1, 2, 3, 4)}


def test_parameters_buffers_and_optimizer_state_are_bitwise_equal_at_world_sizes_1_to_4(
    deterministic_runs: dict[int, list[dict[str, Any]]],
) -> None:
    digests = {world: {r["digest"] for r in runs} for world, runs in deterministic_runs.items()}
    assert all(len(d) == 1 for d in digests.values()), digests  # replicas identical within each run
    assert len(set.union(*digests.values())) == 1, digests  # and across world sizes


def test_each_micro_batch_loss_is_the_same_whichever_rank_computed_it(
    deterministic_runs: dict[int, list[dict[str, Any]]],
) -> None:
    def by_ordinal(runs: list[dict[str, Any]]) -> list[dict[int, float]]:
        merged: list[dict[int, float]] = [{} for _ in range(STEPS)]
        for run in runs:
            for step, results in enumerate(run["losses"]):
                merged[step].update(results)
        return merged

    reference = by_ordinal(deterministic_runs[1])
    assert all(len(step) == K for step in reference)
    for world in (2, 3, 4):
        assert by_ordinal(deterministic_runs[world]) == reference


def _train_single_process_reference() -> dict[str, torch.Tensor]:
    """One process, plain modules: micro-batches in order, float mean of their gradients, same seeds."""
    model, optimizer = _model()
    data = det_data()
    for step in range(STEPS):
        grads: list[list[torch.Tensor | None]] = []
        for k in range(K):
            with torch.random.fork_rng():
                torch.manual_seed(micro_batch_seed(3, step, k))
                x, y = det_micro(data, step, k)
                nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad for p in model.parameters()])
            optimizer.zero_grad(set_to_none=True)
        for p, parts in zip(model.parameters(), zip(*grads)):
            p.grad = torch.stack([g for g in parts if g is not None]).double().sum(0).div(K).float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def test_the_numbers_match_one_process_running_the_micro_batches_in_order(
    deterministic_runs: dict[int, list[dict[str, Any]]],
) -> None:
    reference = _train_single_process_reference()
    state = deterministic_runs[2][0]["state"]
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_the_default_mode_is_not_bitwise_invariant() -> None:
    one, two = (
        run_distributed(_train_default, 1, timeout=TIMEOUT),
        run_distributed(_train_default, 2, timeout=TIMEOUT),
    )
    assert one[0] != two[0]


def _forward_outside_accumulate() -> str:
    model, _ = _model()
    lockstep.replicate(model, policy=lockstep.SyncPolicy(deterministic=True))
    try:
        model(torch.randn(2, 3, 8, 8))
    except UsageError as error:
        return str(error)
    return "no error"


def _wrong_ordinals() -> str:
    model, _ = _model()
    handle = lockstep.replicate(model, policy=lockstep.SyncPolicy(deterministic=True))
    try:
        handle.accumulate(lambda b: None, {0: None, 1: None}, num_micro_batches=4, step=0)
    except ConfigError as error:
        return str(error)
    return "no error"


def test_a_training_forward_outside_accumulate_raises_on_every_rank() -> None:
    messages = run_distributed(_forward_outside_accumulate, 2, timeout=TIMEOUT)
    assert all("inside handle.accumulate" in m for m in messages), messages
    assert "[rank 1/2]" in messages[1]


def test_micro_batches_that_are_not_this_ranks_are_refused() -> None:
    messages = run_distributed(_wrong_ordinals, 2, timeout=TIMEOUT)
    assert "expected this rank's ordinals [0, 2]" in messages[0], messages
    assert "expected this rank's ordinals [1, 3]" in messages[1], messages


def test_settings_that_cannot_apply_are_refused() -> None:
    with pytest.raises(ConfigError, match="static_graph"):
        lockstep.SyncPolicy(deterministic=True, static_graph=True)


def _overflowing() -> dict[str, Any]:
    """Micro-batch 3's loss is 2**20 times the others': its gradients overflow micro-batch 0's scale."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    handle = lockstep.replicate(model, policy=lockstep.SyncPolicy(deterministic=True))
    x = torch.randn(K, 2, 4, generator=torch.Generator().manual_seed(1))

    def micro_step(k: int) -> None:
        (model(x[k]).square().mean() * (2.0**20 if k == 3 else 1.0)).backward()

    handle.accumulate(micro_step, {k: k for k in handle.owned_micro_batches(K)}, num_micro_batches=K, step=0)
    return {
        "grad": [p.grad.clone() for p in model.parameters()],
        "redos": handle.stats().extras["redone_steps"],
    }


def test_a_step_that_overflows_its_scale_is_redone_with_the_same_bits_everywhere() -> None:
    one = run_distributed(_overflowing, 1, timeout=TIMEOUT)[0]
    three = run_distributed(_overflowing, 3, timeout=TIMEOUT)
    assert one["redos"] == 1 and all(r["redos"] == 1 for r in three)
    for run in three:
        for a, b in zip(one["grad"], run["grad"]):
            assert torch.equal(a, b)


def test_sparse_gradients_are_refused() -> None:
    messages = run_distributed(_sparse, 1, timeout=TIMEOUT)
    assert "sparse" in messages[0]


def _sparse() -> str:
    try:
        lockstep.replicate(nn.Embedding(10, 3, sparse=True), policy=lockstep.SyncPolicy(deterministic=True))
    except NotSupportedError as error:
        return str(error)
    return "no error"


class Branchy(nn.Module):
    """Large weights in three buckets (BUCKET_ELEMENTS is lowered in the worker): [layers.2, layers.1],
    [layers.0, odd], [never] in the reverse order of definition. `odd` is used only by odd micro-batches,
    `never` never; the small ones are taken together. A bucket starts inside the last backward when all its
    weights were used by it, and never before the buckets ahead of it (the same order on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.never = nn.Linear(256, 256)
        self.odd = nn.Linear(256, 256)
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(3))  # 65,536 weights each: large
        self.head = nn.Linear(256, 3)

    def forward(self, x: torch.Tensor, ordinal: int) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if ordinal % 2:
            x = torch.tanh(self.odd(x))
        return self.head(x)


def _branchy_grads() -> dict[str, Any]:
    from lockstep.engine.deterministic import exact

    exact.BUCKET_ELEMENTS = 140_000  # two large weights (and their biases) per bucket
    torch.manual_seed(0)
    model = Branchy()
    handle = lockstep.replicate(model, policy=lockstep.SyncPolicy(deterministic=True))
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 256, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(10)]

    def step(index: int) -> list[torch.Tensor | None]:
        def micro(item: tuple[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
            ordinal, (x, y) = item
            nn.functional.cross_entropy(model(x, ordinal), y).backward()

        mine = {k: (k, data[5 * index + k]) for k in handle.owned_micro_batches(5)}
        handle.accumulate(micro, mine, num_micro_batches=5, step=index)
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    first = step(0)
    left_in = step(1)  # the first step's gradients were left in .grad: they are added to
    model.zero_grad(set_to_none=True)
    second = step(1)
    model.zero_grad(set_to_none=False)
    second_after_zeros = step(1)
    grads = {"first": first, "left_in": left_in, "second": second, "after_zeros": second_after_zeros}
    stats = handle.stats()
    return {
        "grads": grads,
        "buckets": stats.num_buckets,
        "overlapped": stats.extras["buckets_launched_in_backward"],
    }


def test_buckets_launched_during_the_last_backward_give_the_same_bits_and_keep_grads_left_in() -> None:
    outcomes = {world: run_distributed(_branchy_grads, world, timeout=TIMEOUT) for world in (1, 2, 3, 4)}
    # the first bucket starts inside every rank's last backward of each of the 4 steps
    assert all(r["buckets"] == 3 and r["overlapped"] >= 4 for results in outcomes.values() for r in results)
    runs = {world: [r["grads"] for r in results] for world, results in outcomes.items()}
    reference = runs[1][0]
    names = [name for name, _ in Branchy().named_parameters()]
    never = [i for i, name in enumerate(names) if name.startswith("never.")]
    for key in ("first", "second"):
        assert all(reference[key][i] is None for i in never)
        assert all(grad is not None for i, grad in enumerate(reference[key]) if i not in never)
    for first, left_in, second in zip(reference["first"], reference["left_in"], reference["second"]):
        if first is not None:
            assert second is not None and left_in is not None and torch.equal(left_in, first + second)
    for after_zeros, second in zip(reference["after_zeros"], reference["second"]):
        assert (
            (after_zeros is None or not after_zeros.any())
            if second is None
            else torch.equal(after_zeros, second)
        )
    for world, results in runs.items():
        for rank, result in enumerate(results):
            for key, grads in result.items():
                for name, a, b in zip(names, reference[key], grads):
                    assert (a is None and b is None) or (
                        a is not None and b is not None and torch.equal(a, b)
                    ), f"world {world} rank {rank} {key}: {name} differs"
