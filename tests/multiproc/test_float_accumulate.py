"""accumulate() under the default policy (live mode's step without deterministic mode): K micro-batches over
the ranks, summed in float by the bucketed all-reduce, scaled into their mean.

The model is test_deterministic's (BatchNorm, SyncBatchNorm, dropout, a weight used twice), trained with
SGD: the oracle is one process running the same micro-batches in order with the same seeds, and the
numbers must agree up to float rounding at world sizes 2 and 4 (K = 6: at 4 ranks two own two micro-
batches and two own one). The replicas of a run must be bitwise identical, running buffers included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lockstep
from lockstep.errors import ConfigError
from lockstep.runtime.micro_batches import micro_batch_seed
from lockstep.testing import run_distributed
from tests.helpers import DET_K as K
from tests.helpers import DET_STEPS as STEPS
from tests.helpers import DetNet, det_data, det_micro, state_digest

TIMEOUT = 120
SEED = 3


def _model() -> tuple[DetNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DetNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train_float() -> dict[str, Any]:
    model, optimizer = _model()
    handle = lockstep.replicate(model)  # the default policy
    data = det_data()
    losses: dict[int, dict[int, float]] = {}

    def micro_step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        return float(loss.detach())

    for step in range(STEPS):
        mine = {k: det_micro(data, step, k) for k in handle.owned_micro_batches(K)}
        losses[step] = handle.accumulate(micro_step, mine, num_micro_batches=K, step=step, seed=SEED)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "digest": state_digest(model, optimizer),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "losses": losses,
        "synced_steps": handle.stats().synced_steps,
    }


def _train_single_process_reference() -> dict[str, Any]:
    """One process, plain modules: the micro-batches in order with their seeds, the mean of their gradients."""
    model, optimizer = _model()
    data = det_data()
    losses: dict[int, dict[int, float]] = {}
    for step in range(STEPS):
        losses[step] = {}
        for k in range(K):
            with torch.random.fork_rng():
                torch.manual_seed(micro_batch_seed(SEED, step, k))
                x, y = det_micro(data, step, k)
                loss = nn.functional.cross_entropy(model(x), y)
                (loss / K).backward()
            losses[step][k] = float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"state": model.state_dict(), "losses": losses}


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])  # world4: slow by the rule
def float_runs(request: pytest.FixtureRequest) -> dict[int, list[dict[str, Any]]]:
    """One world size's runs (each test checks every world it is given): 2, and 4 in make test-all."""
    world = request.param
    return {world: run_distributed(_train_float, world, timeout=TIMEOUT)}


def test_the_replicas_are_identical_buffers_included(float_runs: dict[int, list[dict[str, Any]]]) -> None:
    for world, runs in float_runs.items():
        assert len({r["digest"] for r in runs}) == 1, world


def test_the_numbers_match_one_process_running_the_micro_batches_in_order(
    float_runs: dict[int, list[dict[str, Any]]],
) -> None:
    reference = _train_single_process_reference()
    for world, runs in float_runs.items():
        state = runs[0]["state"]
        for name, value in reference["state"].items():  # parameters and BatchNorm's running buffers
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=f"{name} at {world}")
        merged: dict[int, dict[int, float]] = {step: {} for step in range(STEPS)}
        for (
            run
        ) in runs:  # each micro-batch's loss, whichever rank computed it (dropout seeded per micro-batch)
            for step, results in run["losses"].items():
                merged[step].update(results)
        for step in range(STEPS):
            assert merged[step].keys() == reference["losses"][step].keys()
            for k, loss in merged[step].items():
                assert loss == pytest.approx(reference["losses"][step][k], rel=1e-4), (world, step, k)


def test_each_step_is_one_synced_backward_of_the_bucketed_engine(
    float_runs: dict[int, list[dict[str, Any]]],
) -> None:
    assert {r["synced_steps"] for runs in float_runs.values() for r in runs} == {STEPS}


def _fewer_micro_batches_than_ranks() -> str:
    model, _ = _model()
    handle = lockstep.replicate(model)
    data = det_data()
    mine = {k: det_micro(data, 0, k) for k in handle.owned_micro_batches(1)}
    try:
        handle.accumulate(lambda b: model(b[0]).sum().backward(), mine, num_micro_batches=1, step=0)
    except ConfigError as error:
        return str(error)
    return "no error"


def test_fewer_micro_batches_than_ranks_raise_on_every_rank() -> None:
    messages = run_distributed(_fewer_micro_batches_than_ranks, 2, timeout=TIMEOUT)
    for rank, message in enumerate(messages):
        assert f"rank {rank}/2" in message and "1 micro-batches on 2 ranks" in message, message
        assert "SyncPolicy(deterministic=True)" in message
