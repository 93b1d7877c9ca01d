"""FitConfig validation, --key value overrides, config files, LR schedule, and the jobs' data readers."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import lockstep
from lockstep.errors import ConfigError
from lockstep.jobs import datasets
from lockstep.jobs.catalog import DigitsConfig, GptConfig
from lockstep.jobs.cli import resolve_config
from lockstep.trainer.run.optim import lr_factor
from lockstep.trainer.settings.config import FitConfig, Source
from lockstep.trainer.settings.config_sources import config_from_mapping, read_overrides


def test_overrides_parse_both_spellings() -> None:
    values, sources = read_overrides(["--lr", "0.1", "--max-steps=5", "--sync_batchnorm", "true"])
    assert values == {"lr": "0.1", "max_steps": "5", "sync_batchnorm": "true"}
    assert sources == {
        "lr": Source.flag("--lr"),
        "max_steps": Source.flag("--max-steps"),
        "sync_batchnorm": Source.flag("--sync_batchnorm"),
    }  # named as typed
    with pytest.raises(ConfigError, match="--lr needs a value"):
        read_overrides(["--lr"])
    with pytest.raises(ConfigError, match="--sync-batchnorm needs a value"):
        read_overrides(["--sync-batchnorm", "--lr", "3"])
    with pytest.raises(ConfigError, match="expected --key value"):
        read_overrides(["lr", "3"])


def test_flag_values_are_read_as_field_types() -> None:
    values, sources = read_overrides(
        [
            "--lr",
            "0.5",
            "--max-steps",
            "none",
            "--clip-grad-norm=2",
            "--sync-batchnorm",
            "yes",
            "--precision",
            "bf16",
        ]
    )
    config = config_from_mapping(GptConfig, values, sources)
    assert (config.lr, config.max_steps, config.clip_grad_norm, config.sync_batchnorm) == (
        0.5,
        None,
        2.0,
        True,
    )
    assert config.precision == "bf16"


def test_bad_values_are_named() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown setting\(s\) for FitConfig: 'lrr' from FitConfig\(\.\.\.\) \(did you mean 'lr'\?\)",
    ):
        config_from_mapping(FitConfig, {"lrr": "1"})
    with pytest.raises(
        ConfigError, match=r"precision='fp8' from FitConfig\(\.\.\.\): expected one of 'fp32', 'bf16', 'fp16'"
    ):
        FitConfig(precision="fp8")
    with pytest.raises(ConfigError, match=r"epochs='many' from --epochs: expected an int >= 1"):
        config_from_mapping(FitConfig, *read_overrides(["--epochs", "many"]))
    with pytest.raises(
        ConfigError, match=r"batch_size=0 from FitConfig\(\.\.\.\): expected an int >= 1, got 0"
    ):
        FitConfig(batch_size=0)


def test_file_then_overrides_then_run_dir(tmp_path: Path) -> None:
    path = tmp_path / "digits.yaml"
    path.write_text("epochs: 3\nlr: 0.01\nhidden: 32\n")
    config = resolve_config("digits", str(path), ["--lr", "0.02"], str(tmp_path / "run"))
    assert isinstance(config, DigitsConfig)
    assert (config.epochs, config.lr, config.hidden, config.run_dir) == (3, 0.02, 32, str(tmp_path / "run"))
    (tmp_path / "c.json").write_text(json.dumps({"epochs": 4}))
    assert resolve_config("toy", str(tmp_path / "c.json"), [], None).run_dir == "runs/toy"
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config("toy", str(tmp_path / "nope.yaml"), [], None)


def test_lr_schedule_warmup_and_decay() -> None:
    factors = [lr_factor(s, total_steps=10, warmup_steps=2, schedule="cosine") for s in range(10)]
    assert (
        factors[0] == pytest.approx(0.5)
        and factors[1] == pytest.approx(1.0)
        and factors[2] == pytest.approx(1.0)
    )
    assert all(a >= b for a, b in zip(factors[2:], factors[3:])) and factors[-1] < 0.1
    assert lr_factor(5, total_steps=10, warmup_steps=0, schedule="linear") == pytest.approx(0.5)
    assert lr_factor(7, total_steps=10, warmup_steps=0, schedule="constant") == 1.0


def _write_idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


def test_idx_reader_and_mnist_loader(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for kind, count in (("train", 6), ("t10k", 4)):
        _write_idx(tmp_path / f"{kind}-images-idx3-ubyte.gz", rng.integers(0, 255, (count, 28, 28)), True)
        _write_idx(tmp_path / f"{kind}-labels-idx1-ubyte", rng.integers(0, 10, (count,)), False)
    train, test = datasets.mnist(str(tmp_path))
    assert len(train) == 6 and len(test) == 4
    image, label = train[0]
    assert image.shape == (1, 28, 28) and 0 <= int(label) < 10


def test_missing_mnist_says_what_to_put_where(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"missing train-images-idx3-ubyte.*apt-get install dataset-fashion-mnist"
    ):
        datasets.mnist(str(tmp_path))


def test_truncated_idx_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "x-idx1-ubyte"
    path.write_bytes(struct.pack(">HBBI", 0, 8, 1, 10) + b"\x01\x02")
    with pytest.raises(ConfigError, match="truncated"):
        datasets.read_idx(path)


def test_shipped_data_is_there_and_deterministic() -> None:
    train, test = datasets.digits(seed=0)
    assert len(train) + len(test) == 1797 and len(test) == 360
    again, _ = datasets.digits(seed=0)
    assert bool((train.tensors[1] == again.tensors[1]).all())
    text_train, _, vocab = datasets.stdlib_text(64)
    assert len(text_train) > 1000 and 40 < vocab < 200
    x, y = text_train[3]
    assert x.shape == (64,) and bool((x[1:] == y[:-1]).all())


def test_fit_refuses_an_iterable_dataset_before_any_setup(tmp_path: Path) -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from (torch.zeros(2), torch.ones(2))

    with pytest.raises(ConfigError, match=r"map-style dataset .* for train_data, got Stream"):
        lockstep.fit(
            torch.nn.Linear(2, 1),
            Stream(),
            loss_fn=lambda out, batch: out.sum(),
            config=FitConfig(run_dir=str(tmp_path)),
        )
    assert not list(tmp_path.iterdir())  # nothing was written


def test_a_bool_setting_may_stand_alone_as_a_switch() -> None:
    values, _ = read_overrides(["--deterministic", "--global-batch-size", "64"], switches={"deterministic"})
    assert values == {"deterministic": "true", "global_batch_size": "64"}
    config = config_from_mapping(FitConfig, *read_overrides(["--deterministic"], switches={"deterministic"}))
    assert config.deterministic is True
    with pytest.raises(ConfigError, match="--lr needs a value"):
        read_overrides(["--lr", "--deterministic"], switches={"deterministic"})


def test_shard_optimizer_is_a_flag_of_lockstep_train() -> None:
    assert resolve_config("toy", None, [], None).shard_optimizer is False
    assert resolve_config("toy", None, ["--shard-optimizer", "true"], None).shard_optimizer is True
    assert resolve_config("toy", None, ["--shard-optimizer"], None).shard_optimizer is True
    assert resolve_config("digits", None, ["--shard_optimizer=false"], None).shard_optimizer is False
    with pytest.raises(ConfigError, match="shard_optimizer='maybe' from --shard-optimizer"):
        resolve_config("toy", None, ["--shard-optimizer", "maybe"], None)


def test_shard_optimizer_refuses_periodic_sync() -> None:
    # (overlap_optimizer combines with it: tests/multiproc/test_overlap_shard_optimizer.py)
    from lockstep.trainer.run.optim import maybe_sharded
    from lockstep.trainer.settings.config import plan_of

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert maybe_sharded(optimizer, FitConfig()) is optimizer
    # fit's door (the run's plan, built once in trainer/loop.py) refuses it before anything is sharded
    with pytest.raises(ConfigError, match="shard_optimizer=True with sync='diloco'"):
        plan_of(FitConfig(shard_optimizer=True, sync="diloco"), 1, live=False)


def test_bucket_cap_mb_is_a_number_auto_or_none_from_every_source() -> None:
    assert resolve_config("toy", None, [], None).bucket_cap_mb is None
    assert resolve_config("toy", None, ["--bucket-cap-mb", "auto"], None).bucket_cap_mb == "auto"
    assert resolve_config("toy", None, ["--bucket-cap-mb=10"], None).bucket_cap_mb == 10.0
    assert FitConfig(bucket_cap_mb=4).bucket_cap_mb == 4.0
    assert config_from_mapping(FitConfig, {"bucket_cap_mb": "auto"}).bucket_cap_mb == "auto"
    with pytest.raises(
        ConfigError,
        match=r"bucket_cap_mb='fast' from --bucket-cap-mb: expected a finite float > 0 or one of 'auto' or none",
    ):
        resolve_config("toy", None, ["--bucket-cap-mb", "fast"], None)
    with pytest.raises(
        ConfigError, match=r"bucket_cap_mb=0 from FitConfig\(\.\.\.\): expected a finite float > 0"
    ):
        FitConfig(bucket_cap_mb=0)


def test_bucket_cap_mb_reaches_the_policy_where_there_are_buckets() -> None:
    from lockstep.trainer.run.buckets import fit_policy, tunes_buckets
    from lockstep.trainer.settings.config import plan_of

    assert fit_policy(FitConfig()).bucket_cap_mb == 25.0
    assert fit_policy(FitConfig(bucket_cap_mb="auto")).tune_buckets
    assert tunes_buckets(FitConfig(bucket_cap_mb="auto")) and not tunes_buckets(FitConfig(bucket_cap_mb=10))
    live_cap = FitConfig(bucket_cap_mb=10, global_batch_size=8)
    plan_of(live_cap, 1, live=True)  # a number of MiB runs in live mode
    assert fit_policy(live_cap).bucket_cap_mb == 10.0
    # fit's door (the run's plan, built once in trainer/loop.py) refuses where there are no buckets to size
    with pytest.raises(ConfigError, match="bucket_cap_mb='auto' does not apply with deterministic=True"):
        plan_of(FitConfig(bucket_cap_mb="auto", deterministic=True, global_batch_size=8), 1, live=False)
    with pytest.raises(ConfigError, match="bucket_cap_mb=4.0 does not apply with sync='local_sgd'"):
        plan_of(FitConfig(bucket_cap_mb=4, sync="local_sgd"), 1, live=False)
    with pytest.raises(ConfigError, match="does not run in live mode"):
        plan_of(FitConfig(bucket_cap_mb="auto"), 1, live=True)
