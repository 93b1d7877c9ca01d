"""lockstep.fit with shard_optimizer=True (ZeRO-1): the unsharded run's bits, and checkpoints that hold the
full optimizer state, so that a run resumes exactly at another world size, sharded or not.

The default mode (torch's drop-in face, float all-reduce) is compared with the unsharded run at the same
world size (float sums depend on the world size); deterministic mode (exact sums, the same bits at any
world size) carries the resume legs across world sizes and between sharded and unsharded runs. Summaries
hash every bit of the model and of the full optimizer state (params_sha256, optimizer_sha256), and
compare_checkpoints walks the final checkpoints entry by entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep.checkpoint import compare_checkpoints
from lockstep.jobs import catalog
from lockstep.testing import run_distributed

TIMEOUT = 300
DEFAULT_MODE = {
    "num_samples": 192,
    "batch_size": 8,
    "epochs": 2,
    "lr_schedule": "cosine",
    "warmup_steps": 3,
    "clip_grad_norm": 1.0,
    "checkpoint_every": 5,
    "log_every": 4,
}
DETERMINISTIC = {
    "num_samples": 256,
    "global_batch_size": 24,
    "micro_batch_size": 4,
    "epochs": 2,
    "log_every": 4,
    "deterministic": True,
}
STEPS_PER_EPOCH = 256 // 24


def _train(run_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    config = catalog.ToyConfig(run_dir=run_dir, progress="none", **settings)
    built = catalog.build("toy", config)
    result = lockstep.fit(built.model, built.train_data, loss_fn=built.loss_fn, config=config)
    return {"summary": result.summary, "history": result.history}


def _hashes(result: dict[str, Any]) -> tuple[str, str, int]:
    summary = result["summary"]
    return summary["params_sha256"], summary["optimizer_sha256"], summary["steps"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_default_mode_sharded_gives_the_unsharded_bits(tmp_path: Path, optimizer: str) -> None:
    settings = {**DEFAULT_MODE, "optimizer": optimizer}
    plain = run_distributed(_train, 2, args=(str(tmp_path / "plain"), settings), timeout=TIMEOUT)
    sharded = run_distributed(
        _train, 2, args=(str(tmp_path / "sharded"), {**settings, "shard_optimizer": True}), timeout=TIMEOUT
    )
    assert _hashes(plain[0])[2] == 2 * 192 // 16
    for rank in range(2):
        assert _hashes(sharded[rank]) == _hashes(plain[0]), f"rank {rank}"
    assert sharded[0]["history"] == plain[0]["history"]
    verdict = compare_checkpoints(tmp_path / "plain", tmp_path / "sharded")
    assert verdict.equal, verdict.describe()
    assert verdict.compared > 5


def _legs(run_dir: str, legs: list[tuple[int, bool, int | None]]) -> dict[str, Any]:
    for world, shard, max_steps in legs:
        settings = {**DETERMINISTIC, "shard_optimizer": shard, "max_steps": max_steps}
        leg = run_distributed(_train, world, args=(run_dir, settings), timeout=TIMEOUT)
    return leg[0]


def _assert_resumed_exactly(tmp_path: Path, legs: list[tuple[int, bool, int | None]]) -> None:
    whole = run_distributed(_train, 1, args=(str(tmp_path / "whole"), DETERMINISTIC), timeout=TIMEOUT)[0]
    resumed = _legs(str(tmp_path / "resumed"), legs)
    assert resumed["summary"]["steps"] == 2 * STEPS_PER_EPOCH
    assert resumed["summary"]["steps_this_run"] < 2 * STEPS_PER_EPOCH
    assert _hashes(resumed) == _hashes(whole)
    verdict = compare_checkpoints(tmp_path / "whole", tmp_path / "resumed")
    assert verdict.equal, verdict.describe()


def test_a_sharded_run_resumes_exactly_unsharded_at_another_world_size_and_back(tmp_path: Path) -> None:
    # sharded on 2 ranks -> unsharded on 1 -> sharded on 2, stopping inside epochs 0 and 1
    legs = [(2, True, STEPS_PER_EPOCH // 2), (1, False, STEPS_PER_EPOCH + 3), (2, True, None)]
    _assert_resumed_exactly(tmp_path, legs)


def test_a_sharded_run_resumes_exactly_from_4_to_1_to_3_ranks_and_from_unsharded(tmp_path: Path) -> None:
    legs = [(2, False, 3), (4, True, STEPS_PER_EPOCH // 2), (1, True, STEPS_PER_EPOCH + 1), (3, True, None)]
    _assert_resumed_exactly(tmp_path, legs)


def _local_state_numel(run_dir: str) -> tuple[int, int]:
    """This rank's optimizer state elements in a sharded fit run, and the model's parameter elements."""
    config = catalog.ToyConfig(run_dir=run_dir, progress="none", max_steps=2, shard_optimizer=True)
    built = catalog.build("toy", config)
    seen: list[int] = []

    def record(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # during the sharded step, the optimizer's state is this rank's share (engine/optim/shard_optimizer.py)
        seen.append(sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0))

    def optimizer(params: Any) -> torch.optim.Optimizer:
        made = torch.optim.AdamW(params, lr=1e-3)
        made.register_step_post_hook(record)
        return made

    lockstep.fit(built.model, built.train_data, loss_fn=built.loss_fn, config=config, optimizer=optimizer)
    assert len(seen) == 2, seen  # one step() per step
    return seen[-1], sum(p.numel() for p in built.model.parameters())  # exp_avg(_sq), not step


def test_each_rank_of_a_sharded_fit_holds_a_share_of_the_optimizer_state(tmp_path: Path) -> None:
    results = run_distributed(_local_state_numel, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    params = results[0][1]
    local = [numel for numel, _ in results]
    assert sum(local) == 2 * params, local  # AdamW: exp_avg and exp_avg_sq per parameter element
    assert all(0 < n < 2 * params for n in local), local
