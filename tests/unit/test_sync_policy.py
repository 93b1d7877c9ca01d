"""SyncPolicy split by what reads it (issue 44): every keyword still lands on the policy, and in the one
part that reads it (BucketSettings for the bucketed reducer, PeriodicSettings for the periodic sync);
the defaults, the checks and their messages, `dataclasses.replace` and the derived values are those of
the policy before the split."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest
import torch

from lockstep.engine.core.bucket_settings import BucketSettings
from lockstep.engine.core.periodic_settings import PeriodicSettings
from lockstep.engine.core.policy import BUCKET_KNOBS, PERIODIC_KNOBS, SyncPolicy
from lockstep.errors import ConfigError

REPLICA_KNOBS = ("broadcast_buffers", "deterministic")  # read by engine/replica/, in neither part

# A value other than the default for each knob, with what else it needs to be accepted
BUCKET_VALUES: dict[str, tuple[Any, dict[str, Any]]] = {
    "bucket_cap_mb": (10.0, {}),
    "first_bucket_mb": (0.5, {}),
    "find_unused_parameters": (True, {}),
    "static_graph": (True, {}),
    "gradient_as_bucket_view": (True, {}),
    "reduce_dtype": (torch.bfloat16, {}),
    "upcast_half_precision": (False, {}),
    "torch_bucket_layout": (True, {}),
}
STREAMING = {"sync": "streaming_diloco", "sync_every": 8}
PERIODIC_VALUES: dict[str, tuple[Any, dict[str, Any]]] = {
    "sync": ("diloco", {}),
    "sync_every": (7, {}),
    "outer_lr": (0.5, {}),
    "outer_momentum": (0.5, {}),
    "warmup_steps": (3, {}),
    "mix": (0.25, STREAMING),
    "outer_momentum_warmup": (2, {}),
    "fragment_layout": ("strided", STREAMING),
    "fragment_delay": (2, STREAMING),
    "fragments": (2, STREAMING),
    "delta_dtype": ("int8", {"sync": "diloco"}),
}


def _field_names(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_the_parts_share_out_every_knob_of_the_policy_once() -> None:
    assert tuple(_field_names(BucketSettings)) == BUCKET_KNOBS
    assert tuple(_field_names(PeriodicSettings)) == PERIODIC_KNOBS
    assert not set(BUCKET_KNOBS) & set(PERIODIC_KNOBS)
    assert sorted([*BUCKET_KNOBS, *PERIODIC_KNOBS, *REPLICA_KNOBS]) == sorted(_field_names(SyncPolicy))
    assert set(BUCKET_VALUES) == set(BUCKET_KNOBS) and set(PERIODIC_VALUES) == set(PERIODIC_KNOBS)


def test_the_parts_default_to_the_policys_defaults() -> None:
    policy_defaults = {f.name: f.default for f in dataclasses.fields(SyncPolicy)}
    for part in (BucketSettings, PeriodicSettings):
        for f in dataclasses.fields(part):
            assert f.default == policy_defaults[f.name], f.name
    policy = SyncPolicy()
    assert policy.bucket_settings == BucketSettings()
    assert policy.periodic_settings == PeriodicSettings()


@pytest.mark.parametrize("name", sorted(BUCKET_VALUES))
def test_a_bucket_knob_lands_in_the_bucket_part(name: str) -> None:
    value, needs = BUCKET_VALUES[name]
    policy = SyncPolicy(**needs, **{name: value})
    assert getattr(policy, name) == value  # the policy's own field, as before the split
    assert getattr(policy.bucket_settings, name) == value
    assert policy.periodic_settings == PeriodicSettings(
        **{k: v for k, v in needs.items() if k in PERIODIC_KNOBS}
    )


@pytest.mark.parametrize("name", sorted(PERIODIC_VALUES))
def test_a_periodic_knob_lands_in_the_periodic_part(name: str) -> None:
    value, needs = PERIODIC_VALUES[name]
    policy = SyncPolicy(**{**needs, name: value})
    assert getattr(policy, name) == value
    assert getattr(policy.periodic_settings, name) == value
    assert policy.bucket_settings == BucketSettings()


def test_replace_builds_the_parts_again() -> None:
    """dataclasses.replace (trainer/run/buckets.py, ddp.py) keeps every other knob and rebuilds both parts."""
    policy = SyncPolicy(sync="diloco", sync_every=5, broadcast_buffers=False)
    sized = dataclasses.replace(
        SyncPolicy(static_graph=True), bucket_cap_mb=4.0, gradient_as_bucket_view=True
    )
    assert sized.bucket_settings == BucketSettings(
        bucket_cap_mb=4.0, gradient_as_bucket_view=True, static_graph=True
    )
    assert sized.bucket_cap_bytes == 4 * 1024 * 1024
    again = dataclasses.replace(policy, outer_lr=0.3)
    assert again.periodic_settings == PeriodicSettings(sync="diloco", sync_every=5, outer_lr=0.3)
    assert again.broadcast_buffers is False and again.bucket_settings == BucketSettings()
    with pytest.raises(ConfigError, match="bucket_cap_mb must be a positive number"):
        dataclasses.replace(policy, bucket_cap_mb=0)


def test_the_policy_is_still_a_value_of_its_knobs() -> None:
    policy = SyncPolicy(bucket_cap_mb=5.0, reduce_dtype=torch.float16)
    assert policy == SyncPolicy(bucket_cap_mb=5.0, reduce_dtype=torch.float16) and policy != SyncPolicy()
    assert hash(policy) == hash(SyncPolicy(bucket_cap_mb=5.0, reduce_dtype=torch.float16))
    assert "bucket_settings" not in repr(policy) and "_plan" not in repr(policy)
    for twin in (copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
        assert twin == policy
        assert twin.bucket_settings == policy.bucket_settings
        assert twin.periodic_settings == policy.periodic_settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.bucket_settings.bucket_cap_mb = 1.0  # type: ignore[misc]


def test_the_derived_values_are_the_parts() -> None:
    auto = SyncPolicy(bucket_cap_mb="auto", reduce_dtype=torch.float16)
    assert auto.tune_buckets and auto.bucket_settings.tune_buckets
    assert auto.bucket_cap_bytes == auto.bucket_settings.bucket_cap_bytes == 25 * 1024 * 1024
    assert auto.first_bucket_bytes == auto.bucket_settings.first_bucket_bytes == 1024 * 1024
    assert auto.bucket_dtype(torch.bfloat16) is torch.float16
    half = BucketSettings(upcast_half_precision=False)
    assert half.bucket_dtype(torch.bfloat16) is torch.bfloat16
    assert BucketSettings().bucket_dtype(torch.float16) is torch.float32
    diloco = SyncPolicy(sync="diloco")
    assert diloco.periodic and diloco.algorithm is diloco.periodic_settings.algorithm is not None
    assert not SyncPolicy().periodic and SyncPolicy().algorithm is None


# Each knob's own check, with its message as before the split (the combinations of knobs are the plan's)
CHECKS: list[tuple[dict[str, Any], str]] = [
    ({"bucket_cap_mb": -1}, "SyncPolicy.bucket_cap_mb must be a positive number of MiB or 'auto', got -1"),
    (
        {"bucket_cap_mb": True},
        "SyncPolicy.bucket_cap_mb must be a positive number of MiB or 'auto', got True",
    ),
    ({"first_bucket_mb": 0}, "SyncPolicy.first_bucket_mb must be a positive number of MiB, got 0"),
    (
        {"reduce_dtype": torch.int64},
        "SyncPolicy.reduce_dtype must be None or a floating torch.dtype, got torch.int64",
    ),
    (
        {"sync": "bogus"},
        "SyncPolicy.sync must be one of allreduce, local_sgd, diloco, streaming_diloco; got 'bogus'",
    ),
    ({"sync_every": 0}, "SyncPolicy.sync_every must be an int >= 1, got 0"),
    ({"outer_lr": 0}, "SyncPolicy needs outer_lr > 0 and 0 <= outer_momentum < 1; got 0 and 0.9"),
    ({"outer_momentum": 1.0}, "SyncPolicy needs outer_lr > 0 and 0 <= outer_momentum < 1; got 0.7 and 1.0"),
    ({"warmup_steps": -1}, "SyncPolicy.warmup_steps must be an int >= 0, got -1"),
    ({"outer_momentum_warmup": -1}, "SyncPolicy.outer_momentum_warmup must be an int >= 0, got -1"),
    ({"mix": 1.0}, "SyncPolicy.mix must be in [0, 1), got 1.0"),
    ({"fragments": 0}, "SyncPolicy.fragments must be an int >= 1, got 0"),
    ({"fragment_delay": -1}, "SyncPolicy.fragment_delay must be an int >= 0, got -1"),
    # the periodic knobs are checked first, then the bucket knobs, as before the split
    ({"sync": "bogus", "bucket_cap_mb": -1}, "SyncPolicy.sync must be one of allreduce, local_sgd, diloco, "),
    ({"sync_every": 0, "reduce_dtype": torch.int64}, "SyncPolicy.sync_every must be an int >= 1, got 0"),
    (
        {"bucket_cap_mb": -1, "reduce_dtype": torch.int64},
        "SyncPolicy.bucket_cap_mb must be a positive number",
    ),
]


@pytest.mark.parametrize(("knobs", "message"), CHECKS)
def test_each_check_and_its_message_are_unchanged(knobs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SyncPolicy(**knobs)
    assert type(caught.value) is ConfigError
    assert str(caught.value).startswith(message)


def test_a_part_checks_its_own_knobs_alone() -> None:
    with pytest.raises(ConfigError, match="SyncPolicy.bucket_cap_mb must be a positive number"):
        BucketSettings(bucket_cap_mb=-1)
    with pytest.raises(ConfigError, match="SyncPolicy.sync_every must be an int >= 1"):
        PeriodicSettings(sync_every=0)
