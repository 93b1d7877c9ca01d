"""`lockstep train` end to end: the digits job reaches its accuracy, writes its files, resumes; bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from tests.helpers import child_env, lockstep_cli


@pytest.mark.slow
def test_digits_job_reaches_its_accuracy_and_writes_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "digits"
    proc = lockstep_cli("train", "digits", "-n", "2", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["test_accuracy"] >= 0.95, summary
    assert summary["eval_samples"] == 360  # the whole test split, no padded duplicates
    assert summary["samples_per_second"] > 0 and summary["wall_time_s"] > 0
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run_dir / "config.json").read_text())["epochs"] == 20
    assert (run_dir / "metrics.csv").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert any((run_dir / "checkpoints").iterdir())
    # Started again on the finished run directory: resumes at the end and trains no more steps.
    again = lockstep_cli("train", "digits", "-n", "2", "--run-dir", str(run_dir))
    assert again.returncode == 0, again.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps_this_run"] == 0


@pytest.mark.smoke  # the fast tier's `lockstep train`
def test_toy_job_with_overrides_and_config_file(tmp_path: Path) -> None:
    config = tmp_path / "toy.yaml"
    config.write_text("epochs: 1\nnum_samples: 256\n")
    summary = _toy_run(tmp_path / "toy", config)
    saved = json.loads((tmp_path / "toy" / "config.json").read_text())
    assert (saved["epochs"], saved["num_samples"], saved["batch_size"], saved["max_steps"]) == (1, 256, 16, 5)
    assert summary["steps"] == 5 and "test_accuracy" not in summary
    _two_tracks_of_five_steps(tmp_path / "toy")
    assert 0 < summary["goodput"] <= 1 and summary["samples_lost"] == 0, summary
    # Memory as a number (runtime/memory.py): ToyModel's 165 fp32 parameters, their gradients, AdamW's state.
    memory = summary["memory"]
    assert (memory["params_bytes"], memory["grads_bytes"], memory["sampled_at"]) == (660, 660, "step")
    assert memory["model_state_bytes"] > 0 and memory["peak_bytes"] > 0
    assert memory["peak_source"] == "process_max_rss"
    # ZeRO-1 on 2 ranks: rank 0 holds its share of AdamW's state only. The toy's 4 parameters stay whole
    # units (too small to cut), so the shares are 100 and 65 elements, not exactly half.
    sharded = _toy_run(tmp_path / "toy-sharded", config, "--shard-optimizer", "true")["memory"]
    ratio = sharded["optimizer_bytes"] / memory["optimizer_bytes"]
    assert 0.35 < ratio < 0.65, (sharded, memory)
    assert sharded["params_bytes"] == memory["params_bytes"]
    assert sharded["model_state_bytes"] < memory["model_state_bytes"]


def _two_tracks_of_five_steps(run_dir: Path) -> None:
    """trace.json: a track per rank, each with the run's 5 steps and their phases; timeline.png beside it."""
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert sorted(names.values()) == ["member 0 (rank 0 at start)", "member 1 (rank 1 at start)"]
    for pid in names:
        steps = [e["name"] for e in trace if e["pid"] == pid and e.get("cat") == "step"]
        assert steps == [f"step {n}" for n in range(1, 6)], steps
        phases = {e["name"] for e in trace if e["pid"] == pid and e.get("cat") == "phase"}
        assert {"data loading", "forward", "backward", "optimizer"} <= phases, phases
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_run_leaves_its_timeline_up_to_the_failure(tmp_path: Path) -> None:
    """Without live mode a killed rank ends the job; `lockstep train` then merges what every rank wrote."""
    run_dir = tmp_path / "digits"
    cmd = [sys.executable, "-m", "lockstep", "train", "digits", "-n", "2", "--run-dir", str(run_dir)]
    with subprocess.Popen(cmd, env=child_env(), stderr=subprocess.PIPE, text=True) as proc:
        try:
            parts = run_dir / "trace"
            deadline = time.monotonic() + 60
            while len(list(parts.glob("*.json"))) < 2 or not (run_dir / "metrics.jsonl").stat().st_size:
                assert time.monotonic() < deadline and proc.poll() is None, "the run never trained"
                time.sleep(0.2)  # polling pace only
            time.sleep(2.5)  # a part written since (every 2 s)
            os.kill(int((run_dir / "rank1" / "pid").read_text()), signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode != 0, err
    assert f"lockstep train: the run's timeline up to the failure: {run_dir / 'trace.json'}" in err, err
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert names == {"member 0 (rank 0 at start)", "member 1 (rank 1 at start)"}
    assert any(e.get("cat") == "step" for e in trace) and (run_dir / "timeline.png").is_file()


def _toy_run(run_dir: Path, config: Path, *extra: str) -> dict[str, Any]:
    """The toy job on 2 ranks for 5 steps, with `config` and `extra` options; its summary.json."""
    proc = lockstep_cli(
        "train",
        "toy",
        "-n",
        "2",
        "--run-dir",
        str(run_dir),
        "--config",
        str(config),
        "--batch-size",
        "16",
        "--max-steps",
        "5",
        *extra,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cast(dict[str, Any], json.loads((run_dir / "summary.json").read_text()))


def test_show_config_and_bad_settings(tmp_path: Path) -> None:
    shown = lockstep_cli("train", "gpt", "--show-config", "--lr", "0.01", timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["lr"] == 0.01
    bad = lockstep_cli("train", "toy", "--learning-rate", "3", timeout=60)
    assert (
        bad.returncode == 2
        and "unknown setting(s) for ToyConfig: 'learning_rate' from --learning-rate" in bad.stderr
    )
    wrong = lockstep_cli("train", "toy", "--show-config", "--batch-size", "four", timeout=60)
    assert wrong.returncode == 2
    assert "batch_size='four' from --batch-size: expected an int >= 1" in wrong.stderr, wrong.stderr
    config = tmp_path / "toy.yaml"
    config.write_text("batch_size: 16\nsync_batchnorm: 1\n")
    from_file = lockstep_cli("train", "toy", "--show-config", "--config", str(config), timeout=60)
    assert from_file.returncode == 2
    assert f"sync_batchnorm=1 from {config}: expected a bool (true or false), got an int" in from_file.stderr
    unknown = lockstep_cli("train", "imagenet", timeout=60)
    assert unknown.returncode == 2 and "invalid choice: 'imagenet'" in unknown.stderr


def test_mnist_without_data_says_what_to_do(tmp_path: Path) -> None:
    proc = lockstep_cli(
        "train", "mnist", "-n", "1", "--run-dir", str(tmp_path / "m"), "--data", str(tmp_path), timeout=120
    )
    assert proc.returncode != 0
    assert "apt-get install dataset-fashion-mnist" in proc.stdout + proc.stderr


def test_train_help_reads_well() -> None:
    proc = lockstep_cli("train", "--help", timeout=60)
    assert proc.returncode == 0
    for word in ("digits", "mnist", "resnet", "gpt", "toy", "--run-dir", "-n", "--key value"):
        assert word in proc.stdout
    # the slow-link settings and their defaults (issue 35)
    for words in (
        "--outer-momentum-warmup",
        "(default 10)",
        "--fragment-layout",
        "default sliced",
        "--fragment-delay",
    ):
        assert words in proc.stdout, words
