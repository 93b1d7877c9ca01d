"""The outer sync's wire formats (engine/core/outer_codec.py): int8, int4 and fp4_e3m0 with a float32 scale per
block of 128 values. Round-trip error bounds, the payload's size and layout (nibbles two a byte), zeros,
sizes that are no multiple of a block, inf/NaN refused naming the parameter, float32 on the input's
device, and the same bytes every time."""

from __future__ import annotations

import pytest
import torch

from lockstep.engine.core.outer_codec import (
    BLOCK,
    NonFiniteOuterGradient,
    _pack_nibbles,
    _unpack_nibbles,
    codec_for,
    for_values,
)
from lockstep.errors import ConfigError, GradientError
from lockstep.plan import QUANTIZED_SYNC_DTYPES

QUANTIZED = ("int8", "int4", "fp4_e3m0")
SIZES = (1, 2, 127, 128, 129, 255, 1000, 4097)


def _values(numel: int, seed: int = 0) -> torch.Tensor:
    """Outer-gradient-like values: normal, spread over three orders of magnitude along the vector."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) * torch.logspace(-3, 0, numel)


def _round_trip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = codec_for(name)
    return codec.decode(codec.encode(x), x.numel())


def _peaks(x: torch.Tensor) -> torch.Tensor:
    """Each value's block peak (the largest magnitude of its block of 128)."""
    n = x.numel()
    padded = torch.nn.functional.pad(x.abs(), (0, -n % BLOCK)).view(-1, BLOCK)
    return padded.amax(dim=1).repeat_interleave(BLOCK)[:n]


def test_the_codecs_are_the_plans_quantized_sync_dtypes() -> None:
    assert QUANTIZED_SYNC_DTYPES == QUANTIZED
    for name in QUANTIZED:
        assert codec_for(name).name == name and codec_for(name).quantized
    assert codec_for(None).name == "fp32" and codec_for(torch.bfloat16).name == "bf16"
    with pytest.raises(
        ConfigError, match=r"delta_dtype must be None, .*'int8', 'int4', 'fp4_e3m0'; got 'int3'"
    ):
        codec_for("int3")
    with pytest.raises(ConfigError, match="got torch.int8"):
        codec_for(torch.int8)


@pytest.mark.parametrize("numel", SIZES)
def test_linear_formats_err_by_at_most_half_a_step_of_their_block(numel: int) -> None:
    x = _values(numel)
    for name, top in (("int8", 127), ("int4", 7)):
        y = _round_trip(name, x)
        bound = _peaks(x) / (2 * top) * (1 + 1e-5)  # half a step, plus float32 rounding of the scale
        assert y.shape == x.shape and y.dtype == torch.float32
        assert bool(((y - x).abs() <= bound).all()), (name, numel, float(((y - x).abs() - bound).max()))


@pytest.mark.parametrize("numel", SIZES)
def test_fp4_e3m0_takes_the_nearest_power_of_two_of_the_block_peak(numel: int) -> None:
    x = _values(numel)
    y = _round_trip("fp4_e3m0", x)
    peak = _peaks(x)
    unit = (y.abs() / torch.where(peak > 0, peak, torch.ones_like(peak)))[y != 0]
    levels = torch.exp2(torch.arange(-6, 1, dtype=torch.float32))
    assert bool(torch.isin(unit, levels).all()), "a nonzero value off the levels 2^-6 .. 2^0 of its peak"
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all()), "a sign flipped"
    # between two levels the nearer is within a third of the value; below 2^-6 of the peak, 2^-7 of it
    bound = torch.maximum(x.abs() / 3, peak * 2.0**-7) * (1 + 1e-5)
    assert bool(((y - x).abs() <= bound).all())


def test_fp4_e3m0_rounds_at_the_midpoints() -> None:
    x = torch.tensor([1.0, 0.75, 0.7499, -0.5, 2**-7, 0.99 * 2**-7, 0.0, -1.0, 0.3, 2**-6])
    y = _round_trip("fp4_e3m0", x)
    assert y.tolist() == [1.0, 1.0, 0.5, -0.5, 2**-6, 0.0, 0.0, -1.0, 0.25, 2**-6]


def test_values_on_the_grid_come_back_exactly() -> None:
    int8 = torch.arange(-127, 128, dtype=torch.float32) / 64  # peak 127/64: the codes times 1/64
    assert torch.equal(_round_trip("int8", int8), int8)
    int4 = torch.tensor([-7.0, -3, 0, 1, 5, 7]) * 0.5
    assert torch.equal(_round_trip("int4", int4), int4)
    powers = torch.tensor([8.0, -4, 2, 0.125, -0.25])
    assert torch.equal(_round_trip("fp4_e3m0", powers), powers)


@pytest.mark.parametrize("name", QUANTIZED)
def test_payload_is_the_scales_then_the_codes_and_its_size_is_the_formula(name: str) -> None:
    codec = codec_for(name)
    bits = 8 if name == "int8" else 4
    for numel in SIZES:
        payload = codec.encode(_values(numel))
        blocks = -(-numel // BLOCK)
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        assert payload.numel() == codec.payload_bytes(numel) == 4 * blocks + -(-numel * bits // 8)
    numel = 1 << 20  # large fragments: the scales' overhead is 0.25 bit a value
    ratio = 4 * numel / codec.payload_bytes(numel)
    assert ratio == pytest.approx(32 / (bits + 0.25)) and ratio >= (3.8 if bits == 8 else 7.5)
    x = torch.tensor([3.0, -1.5] + [0.0] * 126 + [0.25])  # two blocks: peaks 3 and 0.25
    scales = codec.encode(x)[:8].view(torch.float32)
    top = {"int8": 127, "int4": 7, "fp4_e3m0": 1}[name]
    assert scales.tolist() == pytest.approx([3.0 / top, 0.25 / top])


def test_nibbles_are_packed_two_a_byte_low_first() -> None:
    codes = torch.tensor([1, 2, 15, 0, 7], dtype=torch.uint8)
    packed = _pack_nibbles(codes)
    assert packed.tolist() == [1 | 2 << 4, 15, 7]  # the odd last code: a zero high nibble
    assert torch.equal(_unpack_nibbles(packed, 5), codes)
    many = torch.randint(0, 16, (1001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_unpack_nibbles(_pack_nibbles(many), 1001), many)


@pytest.mark.parametrize("name", QUANTIZED)
def test_zeros_and_all_zero_blocks_decode_to_zeros(name: str) -> None:
    for numel in (1, 129, 300):
        zeros = torch.zeros(numel)
        assert torch.equal(_round_trip(name, zeros), zeros)
    x = _values(3 * BLOCK)
    x[BLOCK : 2 * BLOCK] = 0  # a zero block between two others: scale 0, codes 0
    y = _round_trip(name, x)
    assert torch.equal(y[BLOCK : 2 * BLOCK], torch.zeros(BLOCK))
    assert codec_for(name).encode(x)[4:8].view(torch.float32).item() == 0.0
    assert torch.equal(_round_trip(name, -x), -y)  # symmetric: the sign travels alone


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_outer_gradient_is_refused_naming_its_parameter(name: str, bad: float) -> None:
    x = _values(300)
    x[205] = bad
    with pytest.raises(NonFiniteOuterGradient) as raised:
        codec_for(name).encode(x, names=["0.weight", "0.bias", "2.weight"], sizes=[200, 3, 97])
    message = str(raised.value)
    assert isinstance(raised.value, GradientError)
    assert f"outer sync in {name}" in message and "1 inf/NaN value(s)" in message
    assert "parameter '2.weight' (value 2 of its 97)" in message
    assert "lower the (inner) learning rate" in message
    with pytest.raises(NonFiniteOuterGradient, match="the first in value 205 of the 300 sent"):
        codec_for(name).encode(x)  # without names: the position in what was sent


def test_floating_buffers_travel_in_float32_beside_quantized_gradients() -> None:
    assert for_values(codec_for("int4")).name == "fp32"
    assert for_values(codec_for(torch.bfloat16)).name == "bf16"  # a cast keeps its dtype, as before


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_same_values_give_the_same_bytes_and_any_input_dtype_decodes_to_float32(name: str) -> None:
    codec = codec_for(name)
    x = _values(1000, seed=7)
    assert torch.equal(codec.encode(x), codec.encode(x.clone()))
    half = codec.decode(codec.encode(x.to(torch.bfloat16)), 1000)
    assert half.dtype == torch.float32 and half.device == x.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", QUANTIZED)
def test_on_cuda_the_payload_and_the_values_stay_on_the_device_with_the_cpus_bits(name: str) -> None:
    codec = codec_for(name)
    x = _values(1000)
    payload = codec.encode(x.cuda())
    assert payload.device.type == "cuda" and torch.equal(payload.cpu(), codec.encode(x))
    y = codec.decode(payload, 1000)
    assert y.device.type == "cuda" and torch.equal(y.cpu(), _round_trip(name, x))
