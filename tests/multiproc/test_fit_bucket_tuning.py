"""lockstep.fit with bucket_cap_mb="auto" (issue 27 item 6): the tuner runs in fit's default steps, the run
keeps the default run's bits at world 2, and summary.json reports the choice and every candidate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import lockstep
from lockstep.testing import run_distributed
from lockstep.trainer.settings.config import FitConfig

TIMEOUT = 180
WIDTH = 256  # 12 layers of 256 x 256: 3 MiB of small gradients, so 1 MiB and 25 MiB give different buckets


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 4))


def _fit(run_dir: str, cap: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(640, WIDTH, generator=gen)  # 20 steps of 32 samples
    train = TensorDataset(x, x[:, :4].clone())
    config = FitConfig(
        run_dir=run_dir,
        batch_size=8,
        grad_accum_steps=2,  # no_sync steps through the handle too
        max_steps=18,
        optimizer="adamw",
        task="regression",
        progress="none",
        bucket_cap_mb=cap,
    )
    result = lockstep.fit(_model(), train, loss_fn=nn.functional.mse_loss, config=config)
    return result.summary


def test_fit_tunes_the_bucket_size_and_keeps_the_default_runs_bits(tmp_path: Path) -> None:
    auto = run_distributed(_fit, 2, args=(str(tmp_path / "auto"), "auto"), timeout=TIMEOUT)
    plain = run_distributed(_fit, 2, args=(str(tmp_path / "plain"), None), timeout=TIMEOUT)
    written = json.loads((tmp_path / "auto" / "summary.json").read_text())
    assert written["config"]["bucket_cap_mb"] == "auto"
    trials = written["bucket_trials"]
    assert [t["cap_mb"] for t in trials] == [1.0, 25.0]  # the others give one of these two layouts
    assert trials[0]["num_buckets"] > trials[1]["num_buckets"]
    for t in trials:  # 2 passes x 2 timed steps, each the max over both ranks
        assert len(t["step_ms"]) == 4 and all(ms > 0 for ms in t["step_ms"]), t
    assert written["bucket_cap_mb"] in (1.0, 25.0) and written["bucket_tuning_reason"]
    assert auto[1]["bucket_trials"] == trials and auto[1]["bucket_cap_mb"] == written["bucket_cap_mb"]
    # world 2: the buckets cannot change a bit (two-term sums), so the drop-in run's bits come back
    assert written["steps"] == plain[0]["steps"] == 18
    assert written["params_sha256"] == plain[0]["params_sha256"]
    assert written["optimizer_sha256"] == plain[0]["optimizer_sha256"]
    assert "bucket_trials" not in plain[0] and "bucket_cap_mb" not in plain[0]
