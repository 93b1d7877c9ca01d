"""`lockstep train gpt --shard-degree N` end to end (issue 45): FSDP and HSDP on torch's FSDP2.

- FSDP 4 and HSDP 2x2 hold a fraction of the replicated run's model state (summary.json's memory), and
  reach its evaluation loss;
- with --deterministic the run ends with the same params_sha256 at world 1, replicated 4, FSDP 4, HSDP
  2x2 and FSDP 2; an FSDP 4 run stopped and resumed as FSDP 2, then as a replicated run, ends with the
  straight run's bits (the checkpoints are DCP's, one shard per rank; one leg saves in the background);
- with --sync diloco (issue 46) the two replica groups meet every H steps on their shards: H times fewer
  bytes between the groups than HSDP's every-step all-reduce (comm_bytes; FSDP2's inside a group apart),
  about its eval loss, and a run stopped mid-round resumes to the straight run's bits.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import lockstep_cli

GPT = ("--dim", "48", "--depth", "2", "--context", "32", "--progress", "none", "--eval-every", "0")
GPT += ("--lr-schedule", "constant", "--warmup-steps", "0")  # each leg's --max-steps shapes no schedule
DETERMINISTIC = ("--deterministic", "--global-batch-size", "16", "--micro-batch-size", "4")  # K = 4


def _train(run_dir: Path, nproc: int, *extra: str) -> dict:
    proc = lockstep_cli(
        "train", "gpt", "-n", str(nproc), "--run-dir", str(run_dir), *GPT, *extra, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_fsdp_and_hsdp_hold_a_fraction_of_the_replicated_model_state(tmp_path: Path) -> None:
    steps = ("--max-steps", "8", "--batch-size", "8")
    ddp = _train(tmp_path / "ddp", 4, *steps)
    fsdp = _train(tmp_path / "fsdp", 4, *steps, "--shard-degree", "4")
    hsdp = _train(tmp_path / "hsdp", 4, *steps, "--shard-degree", "2")
    whole = ddp["memory"]["model_state_bytes"]
    assert fsdp["memory"]["model_state_bytes"] <= 0.30 * whole, (fsdp["memory"], ddp["memory"])
    assert hsdp["memory"]["model_state_bytes"] <= 0.55 * whole, (hsdp["memory"], ddp["memory"])
    assert fsdp["memory"]["params_bytes"] < ddp["memory"]["params_bytes"] / 3
    for run in (fsdp, hsdp):
        assert run["config"]["shard_degree"] in (2, 4) and run["steps"] == 8
        assert abs(run["eval_loss"] - ddp["eval_loss"]) <= 0.01 * ddp["eval_loss"]


def test_deterministic_bits_at_every_layout_and_through_a_resume_across_layouts(tmp_path: Path) -> None:
    legs = ("--max-steps", "6")
    whole = _train(tmp_path / "whole", 1, *DETERMINISTIC, *legs)
    layouts = {
        "replicated 4": (4, ()),
        "fsdp 4": (4, ("--shard-degree", "4")),
        "hsdp 2x2": (4, ("--shard-degree", "2")),
        "fsdp 2": (2, ("--shard-degree", "2")),
    }
    for name, (nproc, extra) in layouts.items():
        run = _train(tmp_path / name.replace(" ", "_"), nproc, *DETERMINISTIC, *legs, *extra)
        assert run["params_sha256"] == whole["params_sha256"], name
        assert run["optimizer_sha256"] == whole["optimizer_sha256"], name
        assert run["eval_loss"] == whole["eval_loss"], name
    resumed = tmp_path / "resumed"
    _train(resumed, 4, *DETERMINISTIC, "--max-steps", "2", "--shard-degree", "4")
    shards = sorted(p.name for p in (resumed / "checkpoints").rglob("*.distcp"))
    assert len(shards) == 4, shards  # one file per rank: nothing gathered to rank 0
    # this leg's checkpoints are written in the background, on a process group of their own
    _train(
        resumed, 2, *DETERMINISTIC, "--max-steps", "4", "--shard-degree", "2", "--checkpoint-async", "true"
    )
    last = _train(resumed, 2, *DETERMINISTIC, *legs)  # replicated, from FSDP 2's checkpoint
    assert last["steps"] == 6 and last["steps_this_run"] == 2
    assert last["params_sha256"] == whole["params_sha256"]
    assert last["optimizer_sha256"] == whole["optimizer_sha256"]


def test_groups_meeting_every_h_steps_send_h_times_fewer_bytes_and_resume_mid_round(tmp_path: Path) -> None:
    steps, every = ("--batch-size", "8", "--shard-degree", "2"), ("--sync", "diloco", "--sync-every", "4")
    hsdp = _train(tmp_path / "hsdp", 4, *steps, "--max-steps", "8")
    diloco = _train(tmp_path / "diloco", 4, *steps, *every, "--max-steps", "8")
    assert diloco["sync"] == "diloco" and diloco["steps"] == 8
    # between the groups: HSDP all-reduces every step, DiLoCo meets twice (8 steps, H = 4)
    assert hsdp["comm_bytes"] >= 4 * diloco["comm_bytes"] > 0, (hsdp["comm_bytes"], diloco["comm_bytes"])
    assert diloco["comm_bytes_in_group"] > 0 and hsdp["comm_bytes_in_group"] > 0
    assert diloco["eval_loss"] <= 1.10 * hsdp["eval_loss"], (diloco["eval_loss"], hsdp["eval_loss"])
    # stopped at step 6, mid-round (the groups differ), and resumed on the same layout
    resumed = tmp_path / "resumed"
    _train(resumed, 4, *steps, *every, "--max-steps", "6")
    last = _train(resumed, 4, *steps, *every, "--max-steps", "8")
    assert last["steps"] == 8 and last["steps_this_run"] == 2
    assert last["params_sha256"] == diloco["params_sha256"]
    assert last["optimizer_sha256"] == diloco["optimizer_sha256"]
    assert last["outer_sha256"] == diloco["outer_sha256"]
