"""The hooks' pure parts, without a process group: PowerSGD's plan and algebra, byte counting, errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lockstep import hooks
from lockstep.engine.comm.compression import BytesCounter, group_of
from lockstep.engine.comm.powersgd import orthogonalize_, plan_bucket
from lockstep.errors import ConfigError


def test_public_names_are_torchs() -> None:
    assert hooks.__all__ == [
        "BytesCounter",
        "HookState",
        "PowerSGDState",
        "allreduce_hook",
        "bf16_compress_hook",
        "fp16_compress_hook",
        "powerSGD_hook",
    ]


def test_plan_compresses_matrices_that_pay_and_sends_the_rest_as_they_are() -> None:
    shapes = [torch.Size(s) for s in [(64, 16), (64,), (4, 64), (4,), (8, 3, 3, 3)]]
    plan = plan_bucket(shapes, rank=1, min_compression_rate=2)
    assert [(m.offset, m.rows, m.cols, m.rank) for m in plan.matrices] == [
        (0, 64, 16, 1),
        (1088, 4, 64, 1),
        (1348, 8, 27, 1),
    ]  # a conv weight is out_channels x the rest
    assert plan.uncompressed == ((1024, 64), (1344, 4))  # the biases, in buffer order
    assert plan.numel == 1024 + 64 + 256 + 4 + 216
    assert plan.p_numel == 64 + 4 + 8 and plan.q_numel == 16 + 64 + 27
    assert plan.compressed_numel == 68 + 76 + 107  # uncompressed + P + Q
    # rank 4: 4x64 costs (4 + 64) * 4 * 2 > 256 -> sent as it is, merged with its neighbours
    plan4 = plan_bucket(shapes[:4], rank=4, min_compression_rate=2)
    assert [(m.rows, m.cols, m.rank) for m in plan4.matrices] == [(64, 16, 4)]
    assert plan4.uncompressed == ((1024, 324),)


def test_rank1_tensors_are_never_compressed_even_when_compression_would_pay() -> None:
    plan = plan_bucket([torch.Size((1000,))], rank=1, min_compression_rate=0.01)
    assert plan.matrices == () and plan.uncompressed == ((0, 1000),)


def test_orthogonalize_gives_orthonormal_columns_and_keeps_zero_columns_zero() -> None:
    m = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    assert not bool(orthogonalize_(m))
    torch.testing.assert_close(m.t() @ m, torch.eye(3), atol=1e-5, rtol=0)
    z = torch.zeros(5, 2)
    assert bool(orthogonalize_(z))
    assert torch.equal(z, torch.zeros(5, 2))  # torch's hook turns this into NaN with epsilon 0


def test_bytes_counter_counts_payloads_per_step() -> None:
    counter = BytesCounter()
    counter.add(torch.zeros(10))
    counter.add(torch.zeros(10, dtype=torch.float16))
    counter.end_step()
    counter.add(torch.zeros(3, dtype=torch.bfloat16))
    counter.end_step()
    assert counter.step_bytes == [60, 6] and counter.total_bytes == 66 and counter.num_collectives == 3
    assert counter.bytes_per_step == 33.0 and counter.last_step_bytes == 6


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"matrix_approximation_rank": 0}, "matrix_approximation_rank=0"),
        ({"start_powerSGD_iter": -1}, "start_powerSGD_iter=-1"),
        ({"min_compression_rate": 0}, "min_compression_rate=0"),
        ({"orthogonalization_epsilon": -1e-8}, "orthogonalization_epsilon=-1e-08"),
    ],
)
def test_powersgd_state_refuses_bad_settings_with_the_value_and_a_fix(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match="expected") as info:
        hooks.PowerSGDState(None, **kwargs)
    assert needle in str(info.value)


def test_a_wrong_state_is_refused_with_how_to_register() -> None:
    with pytest.raises(TypeError, match=r"register_comm_hook\(None, hook\)"):
        group_of("not a group")


def test_hooks_carry_the_annotations_torchs_ddp_checks() -> None:
    for hook in (
        hooks.allreduce_hook,
        hooks.fp16_compress_hook,
        hooks.bf16_compress_hook,
        hooks.powerSGD_hook,
    ):
        assert hook.__annotations__["bucket"] is dist.GradBucket
        assert hook.__annotations__["return"] == torch.futures.Future[torch.Tensor]
    # torch's DDP refuses a hook *named* bf16_compress_hook without CUDA + NCCL; ours runs on gloo
    assert hooks.bf16_compress_hook.__name__ != "bf16_compress_hook"
