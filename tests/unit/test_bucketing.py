"""Bucket assignment (engine/buckets/bucket_layout.py): devices, dtypes, order, caps, rebuild order."""

from __future__ import annotations

import pytest
import torch

from lockstep.engine.buckets.bucket_layout import (
    ParamSpec,
    assign_buckets,
    complete_order,
    specs_from_index_lists,
)
from lockstep.engine.core.policy import SyncPolicy
from lockstep.errors import ConfigError, InternalError

MB = 1024 * 1024


def spec(nbytes: int, device: str = "cpu", dtype: str = "float32", name: str = "") -> ParamSpec:
    return ParamSpec(name=name, numel=nbytes // 4, nbytes=nbytes, device=device, dtype=dtype)


def test_reverse_registration_order_small_first_bucket_then_cap() -> None:
    params = [spec(MB // 2) for _ in range(10)]  # 5 MiB in all
    buckets = assign_buckets(params, cap_bytes=2 * MB, first_cap_bytes=MB)
    assert [b.param_indices for b in buckets] == [(9, 8), (7, 6, 5, 4), (3, 2, 1, 0)]
    assert [b.nbytes for b in buckets] == [MB, 2 * MB, 2 * MB]
    assert [b.index for b in buckets] == [0, 1, 2]


def test_a_large_parameter_gets_a_bucket_of_its_own_and_leftovers_close_at_the_end() -> None:
    params = [spec(100), spec(30 * MB), spec(100)]
    buckets = assign_buckets(params, cap_bytes=25 * MB, first_cap_bytes=MB)
    assert [b.param_indices for b in buckets] == [(2, 1), (0,)]


def test_buckets_never_mix_devices_or_dtypes() -> None:
    # the tutorials' ToyMpModel: layers on two devices; plus a half-precision parameter
    params = [
        spec(400, "cuda:0", name="net1.weight"),
        spec(40, "cuda:0", name="net1.bias"),
        spec(400, "cuda:1", name="net2.weight"),
        spec(40, "cuda:1", name="net2.bias"),
        spec(200, "cuda:1", "float16", name="emb"),
    ]
    buckets = assign_buckets(params, cap_bytes=MB, first_cap_bytes=MB)
    for b in buckets:
        assert len({(params[i].device, params[i].dtype) for i in b.param_indices}) == 1
    assert sorted(i for b in buckets for i in b.param_indices) == list(range(5))
    assert [(b.device, b.dtype) for b in buckets] == [
        ("cuda:1", "float16"),
        ("cuda:1", "float32"),
        ("cuda:0", "float32"),
    ]
    assert [b.param_indices for b in buckets] == [(4,), (3, 2), (1, 0)]


def test_first_bucket_limit_applies_per_device_and_dtype() -> None:
    params = [spec(MB, "cpu"), spec(MB, "meta"), spec(MB, "cpu"), spec(MB, "meta")]
    buckets = assign_buckets(params, cap_bytes=4 * MB, first_cap_bytes=MB)
    assert [b.param_indices for b in buckets] == [(3,), (2,), (1,), (0,)]


def test_observed_order_is_followed_and_buckets_numbered_by_launch() -> None:
    params = [spec(MB) for _ in range(4)]
    buckets = assign_buckets(params, cap_bytes=2 * MB, first_cap_bytes=MB, order=[1, 3, 0, 2])
    assert [b.param_indices for b in buckets] == [(1,), (3, 0), (2,)]


def test_complete_order_dedups_and_appends_unseen_in_reverse() -> None:
    assert complete_order([2, 2, 0], 5) == [2, 0, 4, 3, 1]
    with pytest.raises(InternalError, match="lockstep bug: .*index 7"):  # the reducer's own indices
        complete_order([7], 3)


def test_bad_order_is_a_lockstep_bug_and_bad_caps_a_user_error() -> None:
    params = [spec(4), spec(4)]
    with pytest.raises(InternalError, match="lockstep bug: .*permutation") as info:
        assign_buckets(params, cap_bytes=MB, first_cap_bytes=MB, order=[0, 0])
    assert not isinstance(info.value, ConfigError)  # orders come from the reducer, never from the user
    with pytest.raises(ConfigError, match="positive.*1e-6 MiB"):  # SyncPolicy(bucket_cap_mb=1e-9): 0 bytes
        assign_buckets(params, cap_bytes=0, first_cap_bytes=MB)


def test_policy_sizes_and_reduce_dtype() -> None:
    policy = SyncPolicy()
    assert policy.bucket_cap_bytes == 25 * MB and policy.first_bucket_bytes == MB
    assert SyncPolicy(bucket_cap_mb=0.5).first_bucket_bytes == MB // 2
    assert policy.bucket_dtype(torch.bfloat16) == torch.float32
    assert policy.bucket_dtype(torch.float64) == torch.float64
    assert SyncPolicy(reduce_dtype=torch.bfloat16).bucket_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError):
        SyncPolicy(bucket_cap_mb=-1)
    with pytest.raises(ConfigError):
        SyncPolicy(reduce_dtype=torch.int64)


def test_large_parameters_get_solo_buckets_except_the_last() -> None:
    params = [spec(8 * MB), spec(100), spec(8 * MB), spec(100)]
    buckets = assign_buckets(params, cap_bytes=25 * MB, first_cap_bytes=MB, solo_bytes=4 * MB)
    assert [(b.param_indices, b.solo) for b in buckets] == [((3, 1), False), ((2,), True), ((0,), False)]


def test_specs_from_index_lists_describe_torchs_buckets_in_launch_order() -> None:
    params = [
        ParamSpec("a", 10, 40, "cpu", "torch.float32"),
        ParamSpec("b", 5, 40, "cpu", "torch.float64"),
        ParamSpec("emb", 100, 400, "cpu", "torch.float32", sparse=True),
        ParamSpec("c", 20, 80, "cpu", "torch.float32"),
    ]
    specs = specs_from_index_lists(params, [[3, 0], [2], [1]])
    assert [(s.index, s.param_indices, s.nbytes, s.dtype, s.sparse, s.solo) for s in specs] == [
        (0, (3, 0), 120, "torch.float32", False, False),
        (1, (2,), 400, "torch.float32", True, True),  # a sparse gradient never shares a buffer
        (2, (1,), 40, "torch.float64", False, False),
    ]
    with pytest.raises(InternalError, match="permutation"):
        specs_from_index_lists(params, [[3, 0], [1]])  # a parameter in no bucket
