"""lockstep.fit in deterministic mode: the toy, digits and gpt jobs give the same bits at world sizes 1-4.

Each run trains a few dozen steps of a fixed global batch and returns its summary (params_sha256 and
optimizer_sha256 hash every bit of the model's state_dict and the optimizer's state), its logged
metrics, and its final checkpoint's path; lockstep.checkpoint.compare_checkpoints confirms the hashes
entry by entry. The resize runs stop at world size 4 in the middle of an epoch, resume at 2, stop
again, and finish at 3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import lockstep
from lockstep.checkpoint import compare_checkpoints
from lockstep.jobs import catalog
from lockstep.testing import run_distributed

TIMEOUT = 300
JOBS: dict[str, dict[str, Any]] = {
    "toy": {"num_samples": 256, "global_batch_size": 24, "micro_batch_size": 4, "epochs": 2, "log_every": 4},
    "digits": {"global_batch_size": 48, "micro_batch_size": 8, "max_steps": 24, "epochs": 1, "log_every": 6},
    "gpt": {
        "global_batch_size": 12,
        "micro_batch_size": 3,
        "max_steps": 20,
        "context": 16,
        "dim": 32,
        "depth": 1,
        "log_every": 5,
    },
}


def _train(name: str, run_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    config_cls, _ = catalog.job(name)
    config = config_cls(run_dir=run_dir, progress="none", deterministic=True, **settings)
    built = catalog.build(name, config)
    result = lockstep.fit(
        built.model, built.train_data, loss_fn=built.loss_fn, config=config, eval_data=built.eval_data
    )
    metrics = [{k: v for k, v in record.items()} for record in result.history]
    return {"summary": result.summary, "history": metrics}


def _essentials(run: dict[str, Any]) -> dict[str, Any]:
    summary = run["summary"]
    keep = ("params_sha256", "optimizer_sha256", "steps", "final_train", "eval_loss", "eval_accuracy")
    return {"summary": {k: summary.get(k) for k in keep}, "history": run["history"]}


@pytest.fixture(scope="module", params=sorted(JOBS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    name = request.param
    out = {}
    for world in (1, 2, 3, 4):
        run_dir = tmp_path_factory.mktemp(f"{name}-w{world}")
        out[world] = (
            run_dir,
            run_distributed(_train, world, args=(name, str(run_dir), JOBS[name]), timeout=TIMEOUT),
        )
    return out


def test_parameters_optimizer_state_and_metrics_are_bitwise_equal_at_world_sizes_1_to_4(
    runs: dict[int, Any],
) -> None:
    reference = _essentials(runs[1][1][0])
    assert reference["history"], "the run logged no metrics"
    for world, (run_dir, results) in runs.items():
        assert _essentials(results[0]) == reference, f"world size {world}"  # rank 0 keeps the log
        for rank_result in results[1:]:
            assert _essentials(rank_result)["summary"] == reference["summary"], f"world size {world}"
        verdict = compare_checkpoints(runs[1][0], run_dir)
        assert verdict.equal, verdict.describe()
        assert verdict.compared > 5


def test_a_resize_from_4_to_2_to_3_mid_epoch_gives_the_uninterrupted_runs_bits(tmp_path: Path) -> None:
    settings = dict(JOBS["toy"])  # a constant learning rate: the legs' step budgets do not shape it
    run_dir = str(tmp_path / "resized")
    uninterrupted = run_distributed(
        _train, 1, args=("toy", str(tmp_path / "whole"), settings), timeout=TIMEOUT
    )[0]
    steps_per_epoch = 256 // 24
    legs = [(4, steps_per_epoch // 2), (2, steps_per_epoch + 3), (3, None)]  # stops inside epochs 0 and 1
    for world, max_steps in legs:
        leg = run_distributed(
            _train, world, args=("toy", run_dir, {**settings, "max_steps": max_steps}), timeout=TIMEOUT
        )
    summary = leg[0]["summary"]
    assert summary["steps"] == uninterrupted["summary"]["steps"] == 2 * steps_per_epoch
    assert summary["steps_this_run"] == 2 * steps_per_epoch - (steps_per_epoch + 3)
    assert summary["params_sha256"] == uninterrupted["summary"]["params_sha256"]
    assert summary["optimizer_sha256"] == uninterrupted["summary"]["optimizer_sha256"]
    assert compare_checkpoints(run_dir, tmp_path / "whole").equal
    logged = {r["step"]: r for r in uninterrupted["history"] if "train_loss" in r}
    resumed = json.loads((Path(run_dir) / "summary.json").read_text())["final_train"]
    assert resumed == logged[resumed["step"]]


def _default_mode(run_dir: str) -> str:
    config = catalog.ToyConfig(run_dir=run_dir, progress="none", global_batch_size=24, max_steps=12)
    built = catalog.build("toy", config)
    return lockstep.fit(built.model, built.train_data, loss_fn=built.loss_fn, config=config).summary[
        "params_sha256"
    ]


def test_the_default_mode_with_the_same_global_batch_is_not_bitwise_invariant(tmp_path: Path) -> None:
    one = run_distributed(_default_mode, 1, args=(str(tmp_path / "one"),), timeout=TIMEOUT)[0]
    two = run_distributed(_default_mode, 2, args=(str(tmp_path / "two"),), timeout=TIMEOUT)[0]
    assert one != two
