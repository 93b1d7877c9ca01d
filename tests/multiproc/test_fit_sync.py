"""lockstep.fit with low-communication training (FitConfig.sync): exact resume mid-round, deterministic
repeatability, and comm_bytes in summary.json for every run.

A run stopped mid-round (max_steps) and resumed must end with the uninterrupted run's bits on every rank:
the final checkpoints' `workers` entries (every rank's parameters and inner optimizer state) and `outer`
entry (anchor, outer momentum) are compared tensor by tensor. comm_bytes is checked against the payload
the mode sends: the parameters and float buffers, in float32, once per sync; a synchronous run sends its
gradients every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep.engine.core.outer_codec import codec_for
from lockstep.errors import ConfigError
from lockstep.jobs import catalog
from lockstep.testing import run_distributed

TIMEOUT = 240
SETTINGS: dict[str, Any] = {
    "num_samples": 256,
    "batch_size": 8,
    "epochs": 2,
    "log_every": 4,
    "sync_every": 5,
    "checkpoint_every": 7,
}


def _train(run_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    config_cls, _ = catalog.job("toy")
    config = config_cls(run_dir=run_dir, progress="none", **{**SETTINGS, **settings})
    built = catalog.build("toy", config)
    result = lockstep.fit(
        built.model, built.train_data, loss_fn=built.loss_fn, config=config, eval_data=built.eval_data
    )
    sizes = {
        "params": sum(p.numel() for p in built.model.parameters()),
        "buffers": sum(b.numel() for b in built.model.buffers() if b.is_floating_point()),
    }
    return {"summary": result.summary, "sizes": sizes}


def _final_checkpoint(run_dir: Path) -> dict[str, Any]:
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return torch.load(last / "state.pt", weights_only=True)["entries"]


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    items = (
        tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    )
    for key, value in items:
        out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def _assert_same_states(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    for entry in ("workers", "outer"):
        ta, tb = _tensors(a[entry]), _tensors(b[entry])
        assert ta.keys() == tb.keys(), f"{what}: {entry} holds other tensors"
        for key in ta:
            assert torch.equal(ta[key], tb[key]), f"{what}: {entry}{key} differs"
    assert _tensors(a["workers"]), f"{what}: no worker state saved"
    counts = ("inner_steps", "outer_syncs", "bytes_sent")
    assert [a["outer"][k] for k in counts] == [b["outer"][k] for k in counts], what


@pytest.mark.parametrize(
    "sync, sync_dtype",
    [("local_sgd", "fp32"), ("diloco", "fp32"), ("streaming_diloco", "fp32"), ("diloco", "int4")],
)
def test_a_run_stopped_mid_round_resumes_with_every_ranks_bits(
    sync: str, sync_dtype: str, tmp_path: Path
) -> None:
    extra = {"sync": sync, "fragments": 2 if sync == "streaming_diloco" else 1, "sync_dtype": sync_dtype}
    straight = tmp_path / "straight"
    a = run_distributed(_train, 2, args=(str(straight), extra), timeout=TIMEOUT)[0]
    resumed = tmp_path / "resumed"
    first = run_distributed(_train, 2, args=(str(resumed), {**extra, "max_steps": 13}), timeout=TIMEOUT)
    assert first[0]["summary"]["steps"] == 13  # 13 = 2 rounds of 5 and 3 steps into the third
    b = run_distributed(_train, 2, args=(str(resumed), extra), timeout=TIMEOUT)[0]
    assert a["summary"]["steps_this_run"] == 32 and b["summary"]["steps_this_run"] == 32 - 13
    assert a["summary"]["params_sha256"] == b["summary"]["params_sha256"]
    assert a["summary"]["optimizer_sha256"] == b["summary"]["optimizer_sha256"]
    _assert_same_states(_final_checkpoint(straight), _final_checkpoint(resumed), sync)
    workers = _final_checkpoint(straight)["workers"]
    assert workers["world_size"] == 2 and len(workers["ranks"]) == 2


@pytest.mark.parametrize("sync_dtype", ["fp32", "int8"])
def test_deterministic_diloco_gives_the_same_bits_run_after_run(sync_dtype: str, tmp_path: Path) -> None:
    extra = {
        "sync": "diloco",
        "deterministic": True,
        "global_batch_size": 16,
        "micro_batch_size": 4,
        "sync_dtype": sync_dtype,
    }
    runs = [
        run_distributed(_train, 2, args=(str(tmp_path / f"run{i}"), extra), timeout=TIMEOUT)[0]
        for i in range(2)
    ]
    assert runs[0]["summary"]["params_sha256"] == runs[1]["summary"]["params_sha256"]
    _assert_same_states(
        _final_checkpoint(tmp_path / "run0"), _final_checkpoint(tmp_path / "run1"), "two runs"
    )


@pytest.mark.parametrize(
    "settings, per_sync",
    [
        ({"sync": "allreduce"}, None),
        ({"sync": "local_sgd"}, 4),
        ({"sync": "diloco", "sync_dtype": "bf16"}, 2),
        ({"sync": "diloco", "sync_dtype": "int8"}, "int8"),
    ],
)
def test_comm_bytes_is_what_the_mode_sends(
    settings: dict[str, Any], per_sync: int | str | None, tmp_path: Path
) -> None:
    out = run_distributed(
        _train, 2, args=(str(tmp_path), {**settings, "checkpoint_every": 0}), timeout=TIMEOUT
    )[0]
    summary, sizes = out["summary"], out["sizes"]
    steps = summary["steps"]
    assert steps == 32
    if per_sync is None:  # the gradients in float32 every step
        want = 4 * sizes["params"] * steps
    elif isinstance(per_sync, str):  # quantized outer gradients (one fragment), the buffers in float32
        per_round = codec_for(per_sync).payload_bytes(sizes["params"]) + 4 * sizes["buffers"]
        want = per_round * (steps // SETTINGS["sync_every"])
        assert 3.8 * want < 4 * (sizes["params"] + sizes["buffers"]) * (steps // SETTINGS["sync_every"])
    else:  # parameters and float buffers once per round
        want = per_sync * (sizes["params"] + sizes["buffers"]) * (steps // SETTINGS["sync_every"])
    assert summary["comm_bytes"] == want, (summary["comm_bytes"], want)
    assert summary["comm_bytes_per_sample"] == round(want * 2 / summary["samples_this_run"], 3)
    assert summary["sync"] == settings["sync"]


def test_a_checkpoint_resumes_with_its_own_world_size_only(tmp_path: Path) -> None:
    run_distributed(_train, 2, args=(str(tmp_path), {"sync": "diloco", "max_steps": 7}), timeout=TIMEOUT)
    with pytest.raises(Exception, match="resumes exactly with 2 processes only, not 3: relaunch with -n 2"):
        run_distributed(_train, 3, args=(str(tmp_path), {"sync": "diloco"}), timeout=TIMEOUT)


def test_a_checkpoint_at_a_rounds_end_resumes_at_another_world_size(tmp_path: Path) -> None:
    """max_steps=10 ends the second round of 5 (the replicas equal): 3 processes go on from 2's checkpoint."""
    run_distributed(_train, 2, args=(str(tmp_path), {"sync": "diloco", "max_steps": 10}), timeout=TIMEOUT)
    saved = _final_checkpoint(tmp_path)["workers"]
    assert saved["world_size"] == 2 and saved["round_end"] is True
    out = run_distributed(_train, 3, args=(str(tmp_path), {"sync": "diloco"}), timeout=TIMEOUT)
    summary = out[0]["summary"]
    assert summary["world_size"] == 3 and summary["steps"] == 10 + summary["steps_this_run"] > 10
    assert _final_checkpoint(tmp_path)["workers"]["world_size"] == 3


def _load_saved_workers(round_end: bool) -> dict[str, Any]:
    """On 3 ranks: load a `workers` entry saved by 2 (their momentum buffers 1.0 and 2.0, the parameters
    equal); what each rank's optimizer holds afterwards, or the error."""
    from lockstep.trainer.run.low_comm import WorkerStates

    def worker(momentum: float) -> dict[str, Any]:
        torch.manual_seed(0)
        module = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        module(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        for state in optimizer.state.values():
            state["momentum_buffer"].fill_(momentum)
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict()}

    saved = {"world_size": 2, "ranks": [worker(1.0), worker(2.0)], "round_end": round_end}
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    try:
        WorkerStates(module, optimizer).load_state_dict(saved)
    except ConfigError as exc:
        return {"error": str(exc)}
    buffers = [float(s["momentum_buffer"].flatten()[0]) for s in optimizer.state.values()]
    same = all(
        torch.equal(p, q) for p, q in zip(module.state_dict().values(), saved["ranks"][0]["model"].values())
    )
    return {"momentum": buffers, "parameters_loaded": same}


def test_at_another_world_size_rank_r_takes_saved_rank_r_mod_w_and_mid_round_is_refused() -> None:
    loaded = run_distributed(_load_saved_workers, 3, args=(True,), timeout=TIMEOUT)
    assert [r["momentum"] for r in loaded] == [[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]]
    assert all(r["parameters_loaded"] for r in loaded)
    refused = run_distributed(_load_saved_workers, 3, args=(False,), timeout=TIMEOUT)
    for rank, r in enumerate(refused):
        assert (
            f"[rank {rank}/3] this checkpoint of a low-communication run (sync) was taken in the middle of a round"
            in r["error"]
        )
        assert "relaunch with -n 2, or resume from a checkpoint at a round's end" in r["error"]


def test_sync_settings_are_checked() -> None:
    config_cls, _ = catalog.job("toy")
    with pytest.raises(ConfigError, match="sync='gossip'"):
        config_cls(sync="gossip")
    with pytest.raises(ConfigError, match="sync_dtype='fp8'"):
        config_cls(sync="diloco", sync_dtype="fp8")
    assert config_cls(sync="diloco", sync_dtype="int8").sync_dtype == "int8"


def test_overlap_optimizer_with_sync_takes_the_plain_step_with_the_same_bits(tmp_path: Path) -> None:
    settings = {"sync": "diloco", "checkpoint_every": 0, "max_steps": 12}
    plain = run_distributed(_train, 2, args=(str(tmp_path / "plain"), settings), timeout=TIMEOUT)[0]
    overlap = run_distributed(
        _train, 2, args=(str(tmp_path / "overlap"), {**settings, "overlap_optimizer": True}), timeout=TIMEOUT
    )[0]
    assert overlap["summary"]["params_sha256"] == plain["summary"]["params_sha256"]
    assert overlap["summary"]["optimizer_sha256"] == plain["summary"]["optimizer_sha256"]


def _accumulated(tmp: str) -> dict[str, Any]:
    """2 optimizer steps of 4 accumulated micro-batches on 2 groups of FSDP 2: HSDP, then DiLoCo."""
    common = {"shard_degree": 2, "grad_accum_steps": 4, "max_steps": 2, "epochs": 1}
    hsdp = _train(f"{tmp}/hsdp", common)["summary"]
    diloco = _train(f"{tmp}/diloco", {**common, "sync": "diloco"})["summary"]
    return {"hsdp": hsdp["comm_bytes_in_group"], "diloco": diloco["comm_bytes_in_group"]}


def test_a_sharded_periodic_step_accumulates_under_no_sync_inside_its_group(tmp_path: Path) -> None:
    """Accumulated micro-batches reduce-scatter once a step inside a group, whether the groups then meet
    every step (HSDP) or every H (DiLoCo): the same bytes inside the group."""
    [out, *_] = run_distributed(_accumulated, 4, args=(str(tmp_path),), timeout=TIMEOUT)
    assert out["diloco"] == out["hsdp"] > 0, out
