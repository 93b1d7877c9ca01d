"""Typed settings: every field of FitConfig and of the jobs' configs is checked from Python, files and --flags.

Each error names the field, the value as given (repr), where it came from and the type expected.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep.errors import ConfigError
from lockstep.jobs.catalog import GptConfig, ResnetConfig, ToyConfig
from lockstep.jobs.cli import resolve_config
from lockstep.trainer.settings.config import FitConfig, Source
from lockstep.trainer.settings.config_sources import config_from_mapping, read_overrides

# (settings, the message's "field=value" part, the expected-type part) for each kind of wrong value
WRONG_FROM_PYTHON = [
    ({"batch_size": "4"}, "batch_size='4'", "expected an int >= 1, got a str"),
    ({"batch_size": -4}, "batch_size=-4", "expected an int >= 1, got -4"),
    ({"lr": 0}, "lr=0", "expected a finite float > 0, got 0.0"),
    ({"lr": float("nan")}, "lr=nan", "expected a finite float > 0, got nan"),
    ({"epochs": True}, "epochs=True", "expected an int >= 1, got a bool"),
    ({"sync_batchnorm": 1}, "sync_batchnorm=1", "expected a bool (True or False), got an int"),
    ({"max_steps": 2.0}, "max_steps=2.0", "expected an int >= 1 or None, got a float"),
    ({"clip_grad_norm": "1"}, "clip_grad_norm='1'", "expected a finite float > 0 or None, got a str"),
    ({"precision": "fp8"}, "precision='fp8'", "expected one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
    ({"run_dir": Path("runs/x")}, "run_dir=PosixPath('runs/x')", "expected a str, got a PosixPath"),
]


@pytest.mark.parametrize(("settings", "field", "expected"), WRONG_FROM_PYTHON)
def test_python_values_are_checked_at_construction(
    settings: dict[str, Any], field: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        FitConfig(**settings)
    assert str(caught.value).startswith(f"{field} from FitConfig(...): {expected}")


def test_a_wrong_value_is_a_value_error_and_says_how_to_write_it() -> None:
    with pytest.raises(ValueError, match=re.escape("(e.g. batch_size=32, the default)")):
        FitConfig(batch_size="4")  # ConfigError is a ValueError: code that catches ValueError still works


def test_ints_given_for_floats_become_floats() -> None:
    config = FitConfig(lr=1, weight_decay=0, clip_grad_norm=2)
    assert (config.lr, config.weight_decay, config.clip_grad_norm) == (1.0, 0.0, 2.0)
    assert all(isinstance(v, float) for v in (config.lr, config.weight_decay, config.clip_grad_norm))


def test_job_configs_check_their_own_fields_and_name_their_class() -> None:
    with pytest.raises(
        ConfigError,
        match=re.escape("num_samples='many' from ToyConfig(...): expected an int >= 1, got a str"),
    ):
        ToyConfig(num_samples="many")
    with pytest.raises(
        ConfigError, match=re.escape("heads=0 from GptConfig(...): expected an int >= 1, got 0")
    ):
        GptConfig(heads=0)
    with pytest.raises(
        ConfigError, match=re.escape("width=-1 from ResnetConfig(...): expected an int >= 1, got -1")
    ):
        ResnetConfig(width=-1)
    with pytest.raises(ConfigError, match=re.escape("task='ranking' from ToyConfig(...): expected one of")):
        ToyConfig(task="ranking")  # the inherited bounds hold in subclasses too


def test_fields_assigned_later_are_checked_again_by_validate_and_fit(tmp_path: Path) -> None:
    config = FitConfig(run_dir=str(tmp_path))
    config.batch_size = "8"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=re.escape("batch_size='8' from FitConfig(...)")):
        config.validate()
    with pytest.raises(ConfigError, match=re.escape("batch_size='8' from FitConfig(...)")):
        lockstep.fit(
            torch.nn.Linear(2, 1),
            torch.utils.data.TensorDataset(torch.zeros(4, 2)),
            loss_fn=lambda out, y: out.sum(),
            config=config,
        )
    with pytest.raises(ConfigError, match=r"fit\(config=\{'lr': 0.1\}\): expected a FitConfig"):
        lockstep.fit(
            torch.nn.Linear(2, 1),
            torch.utils.data.TensorDataset(torch.zeros(4, 2)),
            loss_fn=lambda out, y: out.sum(),
            config={"lr": 0.1},
        )  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())  # refused before anything was set up


# (file text, the message's "field=value" part, the expected-type part) for YAML's own types
WRONG_IN_YAML = [
    ("epochs: many\n", "epochs='many'", "expected an int >= 1, got a str"),
    ("epochs: 2.5\n", "epochs=2.5", "expected an int >= 1, got a float"),
    ("epochs: [1, 2]\n", "epochs=[1, 2]", "expected an int >= 1, got a list"),
    ("epochs: true\n", "epochs=True", "expected an int >= 1, got a bool"),
    ("sync_batchnorm: 1\n", "sync_batchnorm=1", "expected a bool (true or false), got an int"),
    (
        "resume: no\n",
        "resume=False",
        "expected one of 'auto', 'never', got a bool",
    ),  # YAML 1.1 reads `no` as false
    ("batch_size: -8\n", "batch_size=-8", "expected an int >= 1, got -8"),
    ("lr: {value: 1}\n", "lr={'value': 1}", "expected a finite float > 0, got a dict"),
    ("lr: .inf\n", "lr=inf", "expected a finite float > 0, got inf"),
    ("lr: '-1e-3'\n", "lr='-1e-3'", "expected a finite float > 0, got -0.001"),
    ("num_samples: 10.0\n", "num_samples=10.0", "expected an int >= 1, got a float"),
]


@pytest.mark.parametrize(("text", "field", "expected"), WRONG_IN_YAML)
def test_yaml_values_are_checked_and_named_with_the_file(
    tmp_path: Path, text: str, field: str, expected: str
) -> None:
    path = tmp_path / "toy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        resolve_config("toy", str(path), [], None)
    message = str(caught.value)
    assert message.startswith(f"{field} from {path}: {expected}"), message
    assert "--" not in message.split("(e.g.")[0]  # a file's value is never reported as a --flag


def test_json_values_are_checked_and_named_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "toy.json"
    path.write_text(json.dumps({"batch_size": "16", "epochs": 2}))
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"batch_size='16' from {path}: expected an int >= 1, got a str (e.g. batch_size: 32, the default)"
        ),
    ):
        resolve_config("toy", str(path), [], None)
    path.write_text(json.dumps({"lr": 0.5, "log_every": 0}))
    with pytest.raises(ConfigError, match=re.escape(f"log_every=0 from {path}: expected an int >= 1, got 0")):
        config_from_mapping(ToyConfig, json.loads(path.read_text()), Source.file(path))  # the workers' path


def test_yaml_exponent_floats_are_read_as_floats(tmp_path: Path) -> None:
    path = tmp_path / "toy.yaml"
    path.write_text("lr: 1e-3\nweight_decay: 5e-4\n")  # pyyaml (YAML 1.1) reads these as strings
    config = resolve_config("toy", str(path), [], None)
    assert (config.lr, config.weight_decay) == (1e-3, 5e-4)


def test_unknown_keys_are_named_with_their_source_and_a_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "toy.yaml"
    path.write_text("epoch: 3\n")
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"unknown setting(s) for ToyConfig: 'epoch' from {path} "
            "(did you mean 'epochs'?); known settings: batch_size,"
        ),
    ):
        resolve_config("toy", str(path), [], None)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "unknown setting(s) for ToyConfig: 'batchsize' from --batchsize "
            "(did you mean 'batch_size'?), 'learning_rate' from "
            "--learning-rate; known settings: batch_size,"
        ),
    ):
        resolve_config("toy", None, ["--learning-rate", "0.1", "--batchsize=8"], None)


def test_malformed_files_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{epochs: 2}")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        resolve_config("toy", str(tmp_path / "bad.json"), [], None)
    (tmp_path / "bad.yaml").write_text("epochs: [2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        resolve_config("toy", str(tmp_path / "bad.yaml"), [], None)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping of settings, got list"):
        resolve_config("toy", str(tmp_path / "list.yaml"), [], None)


# (flags, the message's "field=value from --flag" part, the expected-type part)
WRONG_FROM_FLAGS = [
    (
        ["--batch-size", "four"],
        "batch_size='four' from --batch-size",
        "expected an int >= 1, got text that does not read as one",
    ),
    (
        ["--batch-size=2.5"],
        "batch_size='2.5' from --batch-size",
        "expected an int >= 1, got text that does not read as one",
    ),
    (["--batch-size", "-2"], "batch_size='-2' from --batch-size", "expected an int >= 1, got -2"),
    (
        ["--lr", "fast"],
        "lr='fast' from --lr",
        "expected a finite float > 0, got text that does not read as one",
    ),
    (["--lr", "inf"], "lr='inf' from --lr", "expected a finite float > 0, got inf"),
    (
        ["--sync-batchnorm", "2"],
        "sync_batchnorm='2' from --sync-batchnorm",
        "expected a bool (true or false), got text",
    ),
    (
        ["--epochs", "true"],
        "epochs='true' from --epochs",
        "expected an int >= 1, got text that does not read as one",
    ),
    (["--max-steps", "0"], "max_steps='0' from --max-steps", "expected an int >= 1 or none, got 0"),
    (["--device", "tpu"], "device='tpu' from --device", "expected one of 'auto', 'cpu', 'cuda', got 'tpu'"),
]


@pytest.mark.parametrize(("flags", "field", "expected"), WRONG_FROM_FLAGS)
def test_flag_values_are_checked_and_named_with_the_flag(flags: list[str], field: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_config("toy", None, flags, None)
    assert str(caught.value).startswith(f"{field}: {expected}"), str(caught.value)


def test_flags_override_the_file_and_each_value_keeps_its_own_source(tmp_path: Path) -> None:
    path = tmp_path / "toy.yaml"
    path.write_text("batch_size: 0\nepochs: 2\n")
    config = resolve_config("toy", str(path), ["--batch-size", "8"], None)  # the flag fixes the file's value
    assert (config.batch_size, config.epochs) == (8, 2)
    path.write_text("batch_size: 8\nepochs: 0\n")
    with pytest.raises(ConfigError, match=re.escape(f"epochs=0 from {path}:")):
        resolve_config("toy", str(path), ["--batch-size", "8"], None)
    path.write_text("run_dir: 5\n")
    with pytest.raises(ConfigError, match=re.escape(f"run_dir=5 from {path}: expected a str, got an int")):
        resolve_config("toy", str(path), [], None)
    assert resolve_config("toy", str(path), [], str(tmp_path / "run")).run_dir == str(
        tmp_path / "run"
    )  # --run-dir wins
    flags = read_overrides(["--sync-batchnorm", "off", "--max-steps", "None", "--clip-grad-norm", "null"])
    config = config_from_mapping(GptConfig, *flags)
    assert (config.sync_batchnorm, config.max_steps, config.clip_grad_norm) == (False, None, None)
