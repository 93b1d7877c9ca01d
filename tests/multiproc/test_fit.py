"""lockstep.fit on real gloo ranks: world-size invariance, accumulation, resume, exact eval, metrics."""

from __future__ import annotations

import json
import warnings
from collections import namedtuple
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import lockstep
from lockstep.jobs.models import ToyModel
from lockstep.testing import run_distributed
from lockstep.trainer.settings.config import FitConfig
from tests.helpers import HostCopyCounter


def _data() -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 10, generator=gen)
    y = x @ torch.randn(10, 5, generator=gen)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


def _fit_toy(
    run_dir: str,
    batch_size: int,
    accum: int,
    max_steps: int | None,
    epochs: int = 2,
    checkpoint_every: int = 3,
) -> dict:
    torch.manual_seed(0)
    model = ToyModel()
    train, test = _data()
    config = FitConfig(
        run_dir=run_dir,
        batch_size=batch_size,
        grad_accum_steps=accum,
        epochs=epochs,
        max_steps=max_steps,
        optimizer="sgd",
        momentum=0.0,
        lr=0.05,
        task="regression",
        log_every=2,
        checkpoint_every=checkpoint_every,
        progress="lines",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lockstep.fit(model, train, loss_fn=nn.functional.mse_loss, config=config, eval_data=test)
    repeated = [str(w.message) for w in caught if "second full pass" in str(w.message)]
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "summary": result.summary,
        "repeated_epoch_warnings": repeated,
    }


def _assert_same_params(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-6) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-5)


def test_same_global_batch_gives_same_training_at_any_world_size(tmp_path: Path) -> None:
    # 2 ranks x batch 4 x accum 2 == 1 rank x batch 8 x accum 2 == 1 rank x batch 16: one global batch of 16.
    two = run_distributed(_fit_toy, 2, args=(str(tmp_path / "ws2"), 4, 2, None), timeout=120)
    one = run_distributed(_fit_toy, 1, args=(str(tmp_path / "ws1"), 8, 2, None), timeout=120)
    big = run_distributed(_fit_toy, 1, args=(str(tmp_path / "big"), 16, 1, None), timeout=120)
    _assert_same_params(two[0]["params"], two[1]["params"], atol=0)
    _assert_same_params(two[0]["params"], one[0]["params"])
    _assert_same_params(one[0]["params"], big[0]["params"])
    summary = json.loads((tmp_path / "ws2" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 8 and summary["global_batch_size"] == 16
    assert summary["eval_samples"] == 32  # every eval sample exactly once, no padding
    assert summary["eval_loss"] == two[1]["summary"]["eval_loss"]


def test_resume_continues_exactly(tmp_path: Path) -> None:
    full = run_distributed(_fit_toy, 2, args=(str(tmp_path / "full"), 4, 1, None), timeout=120)
    run_distributed(
        _fit_toy, 2, args=(str(tmp_path / "part"), 4, 1, 5), timeout=120
    )  # stops mid-epoch 0, at step 5 of 8
    resumed = run_distributed(_fit_toy, 2, args=(str(tmp_path / "part"), 4, 1, None), timeout=120)
    assert resumed[0]["summary"]["steps_this_run"] == 16 - 5
    _assert_same_params(resumed[0]["params"], full[0]["params"], atol=0)
    # fit calls set_epoch each epoch: the sampler's repeated-epoch warning never fires, resumed or not
    assert [rank["repeated_epoch_warnings"] for rank in full + resumed] == [[]] * 4
    # The logs hold the whole history once: what the first part logged, then the rest.
    lines = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    train_steps = [json.loads(line)["step"] for line in lines if "train_loss" in json.loads(line)]
    assert train_steps == [2, 4, 5, 6, 8, 10, 12, 14, 16]
    assert (tmp_path / "part" / "metrics.csv").read_text().count("\n") == len(lines) + 1


def test_resume_from_a_checkpoint_on_an_epochs_last_step(tmp_path: Path) -> None:
    # 8 steps per epoch; checkpoint_every=4 saves step 8 before the loop counts epoch 0 as done (as a run
    # killed right after that save leaves it): the resumed run must go on with epoch 1, not replay epoch 0.
    full = run_distributed(_fit_toy, 2, args=(str(tmp_path / "full"), 4, 1, None, 2, 4), timeout=120)
    run_distributed(_fit_toy, 2, args=(str(tmp_path / "part"), 4, 1, 8, 2, 4), timeout=120)
    resumed = run_distributed(_fit_toy, 2, args=(str(tmp_path / "part"), 4, 1, None, 2, 4), timeout=120)
    assert resumed[0]["summary"]["steps_this_run"] == 8
    assert resumed[0]["summary"]["epochs_completed"] == 2
    _assert_same_params(resumed[0]["params"], full[0]["params"], atol=0)
    assert [rank["repeated_epoch_warnings"] for rank in full + resumed] == [[]] * 4
    records = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [8, 16]  # each epoch's evaluation once


def test_logs_are_written_on_rank0(tmp_path: Path) -> None:
    run_distributed(_fit_toy, 2, args=(str(tmp_path / "run"), 4, 1, 6), timeout=120)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "train_loss" in r]
    assert steps == [2, 4, 6]
    assert all(r["train_loss"] > 0 for r in records if "train_loss" in r)
    assert (tmp_path / "run" / "metrics.csv").read_text().startswith("step,")


def test_resume_at_another_world_size_with_the_same_global_batch(tmp_path: Path) -> None:
    full = run_distributed(_fit_toy, 2, args=(str(tmp_path / "full"), 4, 1, None), timeout=120)
    run_distributed(_fit_toy, 2, args=(str(tmp_path / "part"), 4, 1, 5), timeout=120)
    # Continue on 1 rank with batch 8: the same global batches of 8, in the same order.
    resumed = run_distributed(_fit_toy, 1, args=(str(tmp_path / "part"), 8, 1, None), timeout=120)
    assert resumed[0]["summary"]["steps_this_run"] == 16 - 5
    _assert_same_params(resumed[0]["params"], full[0]["params"], atol=1e-5)


Features = namedtuple("Features", ["x", "scale"])


class _StructuredData(Dataset):
    """The same samples as _data(), as (Features(x, scale), {"y": y}): a namedtuple and a dict per batch."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Features, dict[str, torch.Tensor]]:
        x, y = self.data[index]
        return Features(x=x, scale=torch.tensor(1.0)), {"y": y}


class _ToyOnFeatures(ToyModel):
    def forward(self, features: Features) -> torch.Tensor:  # type: ignore[override]
        assert type(features) is Features, type(features)  # the batch kept its type on the way to the device
        return super().forward(features.x * features.scale.unsqueeze(-1))


def _fit_structured_counting_host_copies(run_dir: str, structured: bool) -> dict:
    torch.manual_seed(0)
    model = _ToyOnFeatures() if structured else ToyModel()
    train, test = _data()

    def loss_fn(outputs: torch.Tensor, targets: Any) -> torch.Tensor:
        loss = nn.functional.mse_loss(outputs, targets["y"] if structured else targets)
        return loss.as_subclass(HostCopyCounter) if structured else loss

    config = FitConfig(
        run_dir=run_dir,
        batch_size=4,
        grad_accum_steps=2,
        epochs=2,
        optimizer="sgd",
        momentum=0.0,
        lr=0.05,
        task="regression",
        log_every=3,
        progress="lines",
    )
    HostCopyCounter.calls.clear()
    data = (_StructuredData(train), _StructuredData(test)) if structured else (train, test)
    result = lockstep.fit(model, data[0], loss_fn=loss_fn, config=config, eval_data=data[1])
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "summary": result.summary,
        "host_copies": list(HostCopyCounter.calls),
    }


def test_structured_batches_and_metrics_copied_to_the_host_on_log_steps_only(tmp_path: Path) -> None:
    # 64 samples on 2 ranks x batch 4 x accum 2: 8 steps over 2 epochs, 16 micro-batches and 2 evaluations per rank
    plain = run_distributed(
        _fit_structured_counting_host_copies, 2, args=(str(tmp_path / "plain"), False), timeout=120
    )
    structured = run_distributed(
        _fit_structured_counting_host_copies, 2, args=(str(tmp_path / "nested"), True), timeout=120
    )
    _assert_same_params(structured[0]["params"], plain[0]["params"], atol=0)
    for key in ("eval_loss", "final_train"):
        assert structured[0]["summary"][key] == plain[0]["summary"][key]
    records = [json.loads(line) for line in (tmp_path / "nested" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [3, 6, 8]  # log_every=3, then the run's end
    assert [r["step"] for r in records if "eval_loss" in r] == [4, 8]  # each epoch's end
    # The loss's value reaches the host once per record (one packed copy), never per micro-batch (16 of them).
    assert [rank["host_copies"] for rank in structured] == [["tolist"] * len(records)] * 2
