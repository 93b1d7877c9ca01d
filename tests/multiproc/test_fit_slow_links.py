"""lockstep.fit over slow links (issue 35): DiLoCo's data-parallel warm-up, the final streaming merge, and
the defaults' quality on the gpt job.

- sync_warmup=W: the first W steps average the gradients (comm_bytes counts them: the parameters in
  float32 each step), the replicas are equal after them, and the rounds start from there;
- a streaming run whose last fragment is in flight at its last step applies it before the last
  checkpoint and evaluation: with fragment_mix=0 the merged fragment is the outer step's result alone,
  which the run one step longer applies after its step 13, so the two hold the same bits there;
- the defaults (outer momentum warm-up, sliced fragments): the gpt job's 60-step run with `--sync diloco
  --sync-every 10` (and streaming with 4 fragments) within 1.10x of all-reduce's eval loss, with >= 5x
  fewer comm_bytes (benchmarks/results/2026-11-27-diloco_defaults.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep.jobs import catalog
from lockstep.testing import run_distributed

TIMEOUT = 240
TOY: dict[str, Any] = {"num_samples": 256, "batch_size": 8, "epochs": 2, "log_every": 4, "sync_every": 5}


def _train(job: str, run_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    config_cls, _ = catalog.job(job)
    config = config_cls(run_dir=run_dir, progress="none", **settings)
    built = catalog.build(job, config)
    result = lockstep.fit(
        built.model, built.train_data, loss_fn=built.loss_fn, config=config, eval_data=built.eval_data
    )
    return {
        "summary": result.summary,
        "state": {k: v.clone() for k, v in built.model.state_dict().items()},
        "params": sum(p.numel() for p in built.model.parameters()),
    }


def _final_checkpoint(run_dir: Path) -> dict[str, Any]:
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return torch.load(last / "state.pt", weights_only=True)["entries"]


def test_the_data_parallel_warmup_is_counted_and_leaves_equal_replicas(tmp_path: Path) -> None:
    settings = {**TOY, "sync": "diloco", "sync_warmup": 3, "checkpoint_every": 0}
    out = run_distributed(_train, 2, args=("toy", str(tmp_path / "a"), settings), timeout=TIMEOUT)[0]
    steps, params = out["summary"]["steps"], out["params"]
    assert steps == 32
    # the gradients every warm-up step, then the outer gradients once per round of 5 after it
    assert out["summary"]["comm_bytes"] == 4 * params * 3 + 4 * params * ((steps - 3) // 5)
    short = {**settings, "max_steps": 3}
    run_distributed(_train, 2, args=("toy", str(tmp_path / "b"), short), timeout=TIMEOUT)
    workers = _final_checkpoint(tmp_path / "b")["workers"]
    assert workers["round_end"]  # at the warm-up's end every replica is equal: resumable at any size
    for key, value in workers["ranks"][0]["model"].items():
        assert torch.equal(value, workers["ranks"][1]["model"][key]), key


def test_the_fragment_in_flight_at_the_last_step_is_applied_before_the_end(tmp_path: Path) -> None:
    # strided, 2 fragments of the toy model: net1 (fragment 0, synced after steps 2, 7, 12) and net2
    settings = {
        **TOY,
        "sync": "streaming_diloco",
        "fragments": 2,
        "fragment_layout": "strided",
        "fragment_mix": 0.0,
        "checkpoint_every": 0,
    }
    short = run_distributed(
        _train, 2, args=("toy", str(tmp_path / "a"), {**settings, "max_steps": 12}), timeout=TIMEOUT
    )
    longer = run_distributed(
        _train, 2, args=("toy", str(tmp_path / "b"), {**settings, "max_steps": 13}), timeout=TIMEOUT
    )
    final = _final_checkpoint(tmp_path / "a")
    assert final["outer"]["pending"] == []  # nothing left in flight in the last checkpoint
    for rank in (0, 1):
        assert short[rank]["summary"]["final_merge_applied"] is True
        assert longer[rank]["summary"]["final_merge_applied"] is False  # step 13 launches none
        for name in ("net1.weight", "net1.bias"):
            assert torch.equal(short[rank]["state"][name], longer[rank]["state"][name]), (rank, name)
        for name, value in short[rank]["state"].items():  # the model fit returns is the checkpoint's
            assert torch.equal(value, final["workers"]["ranks"][rank]["model"][name]), (rank, name)


@pytest.mark.slow
def test_the_defaults_keep_the_gpt_jobs_loss_with_a_tenth_of_the_bytes(tmp_path: Path) -> None:
    base = {"batch_size": 16, "eval_every": 0, "max_steps": 60}
    runs = {}
    for name, extra in {
        "allreduce": {},
        "diloco": {"sync": "diloco", "sync_every": 10},
        "streaming": {"sync": "streaming_diloco", "sync_every": 10, "fragments": 4},
    }.items():
        args = ("gpt", str(tmp_path / name), {**base, **extra})
        runs[name] = run_distributed(_train, 2, args=args, timeout=600)[0]["summary"]
    ddp = runs["allreduce"]
    for name in ("diloco", "streaming"):
        assert runs[name]["eval_loss"] <= 1.10 * ddp["eval_loss"], (
            name,
            runs[name]["eval_loss"],
            ddp["eval_loss"],
        )
        assert runs[name]["comm_bytes"] * 5 <= ddp["comm_bytes"], name
