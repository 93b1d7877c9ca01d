"""The outer sync's wire formats: how a rank's float32 values travel to the others, and back to float32.

OuterSync (engine/periodic/outer_sync.py) averages each fragment's outer gradients over the ranks. The values
travel in `SyncPolicy.delta_dtype` ("sync_dtype" in fit and `lockstep train`), one codec each:

- fp32 (None), bf16, fp16: a cast (`Cast`);
- int8: per block of BLOCK = 128 consecutive values, one float32 scale (the block's largest magnitude /
  127) and one signed byte per value, rounded to nearest: 8.25 bits a value, 3.88x fewer than float32;
- int4: the same with 4-bit codes in -7..7 (scale: largest magnitude / 7), two per byte: 4.25 bits a
  value, 7.53x fewer;
- fp4_e3m0: Streaming DiLoCo's 4-bit format (1 sign, 3 exponent bits, no mantissa), per block of 128 with
  a float32 scale (the largest magnitude): magnitudes 0 and scale * 2^-6 .. scale * 2^0, the nearest
  one taken; 4.25 bits a value.

Quantized values cannot be summed by the backend (each rank has its own scales). Over 2 ranks (and
half-precision values over any number) every contribution is all-gathered as one uint8 payload (the
scales' bytes, then the codes) and each rank decodes every rank's payload to float32 and sums them in
rank order: every rank gets the same bits, run after run. A payload p is `payload_bytes(n)` bytes; an
all-gather sends it to each of the other W - 1 ranks ((W - 1) p per rank on the wire), where a float32
ring all-reduce sends 2 (W - 1) / W * 4n per rank: the gather saves 8n / (W p), the payload ratio 4n / p
at W = 2 but half of it at W = 4. From W = 3 quantized outer gradients take a reduce-scatter of encoded
chunks and an all-gather of the re-encoded mean chunks instead (engine/periodic/outer_reduce.py): about
2 (W - 1) / W * p per rank on the wire, the payload ratio at any W, for a second quantization of the
mean. comm_bytes counts the bytes a rank's inputs send to other ranks, each once, as for every mode:
p for the gather, about p for the two phases (`outer_reduce.sent_bytes`).

Only outer gradients are quantized: floating buffers (BatchNorm statistics) are values, not differences,
and travel in float32 (`for_values`). A block's scale must be finite: a non-finite outer gradient (the
replica diverged) raises NonFiniteOuterGradient naming the parameter, instead of turning into finite
garbage on every rank. The codecs are plain tensor code, on the values' device (CPU or CUDA).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep.errors import ConfigError, GradientError
from lockstep.plan import QUANTIZED_SYNC_DTYPES

BLOCK = 128  # values per float32 scale: 32 / 128 = 0.25 bits a value of overhead
_SCALE_BYTES = 4


class NonFiniteOuterGradient(GradientError):
    """A quantized outer sync met an inf or NaN in the values a rank sends."""


class Codec:
    """Float32 values to a 1-D payload of this format and back (the base: a cast to `dtype`)."""

    name = "fp32"
    quantized = False

    def __init__(self, dtype: torch.dtype = torch.float32, name: str = "fp32") -> None:
        self.dtype, self.name = dtype, name

    def encode(
        self, flat: torch.Tensor, *, names: Sequence[str] = (), sizes: Sequence[int] = ()
    ) -> torch.Tensor:
        return flat.to(self.dtype)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return payload.float()

    def payload_bytes(self, numel: int) -> int:
        return numel * torch.empty((), dtype=self.dtype).element_size()


class _Blocks(Codec, ABC):
    """Per-block float32 scales, then the codes: the payload is uint8."""

    quantized = True
    bits = 8  # a code's width
    linear = True  # codes are multiples of scale / top (int8, int4); else powers of two (fp4_e3m0)
    top = 127.0  # the largest code of a linear format

    def __init__(self) -> None:
        super().__init__(torch.uint8, self.name)

    def payload_bytes(self, numel: int) -> int:
        return _SCALE_BYTES * _blocks(numel) + math.ceil(numel * self.bits / 8)

    def encode(
        self, flat: torch.Tensor, *, names: Sequence[str] = (), sizes: Sequence[int] = ()
    ) -> torch.Tensor:
        numel = flat.numel()
        blocks = torch.nn.functional.pad(flat.float(), (0, _blocks(numel) * BLOCK - numel)).view(-1, BLOCK)
        peak = blocks.abs().amax(dim=1)  # NaN propagates: a block with a NaN has a NaN peak
        if not bool(torch.isfinite(peak).all()):
            raise NonFiniteOuterGradient(_non_finite(self.name, flat, names, sizes))
        # The values in [-1, 1] of their block's peak (an all-zero block: divided by 1, its codes stay 0)
        unit = blocks / torch.where(peak > 0, peak, torch.ones_like(peak)).unsqueeze(1)
        scale = peak / self.top if self.linear else peak  # what a decoded code is multiplied by
        codes = self._codes(unit).reshape(-1)[:numel]
        packed = _pack_nibbles(codes) if self.bits == 4 else codes
        return torch.cat([scale.contiguous().view(torch.uint8), packed])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        count = _blocks(numel)
        scale = payload[: _SCALE_BYTES * count].view(torch.float32)
        body = payload[_SCALE_BYTES * count :]
        codes = _unpack_nibbles(body, numel) if self.bits == 4 else body
        values = torch.nn.functional.pad(self._values(codes), (0, count * BLOCK - numel)).view(-1, BLOCK)
        return (values * scale.unsqueeze(1)).reshape(-1)[:numel]

    @abstractmethod
    def _codes(self, unit: torch.Tensor) -> torch.Tensor:
        """Values in [-1, 1] (of the block's peak) to uint8 codes."""

    @abstractmethod
    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes back to float32 multiples of the block's scale."""


class Int8(_Blocks):
    """Symmetric int8: round(x / scale) in -127..127, stored as its two's complement byte."""

    name = "int8"

    def _codes(self, unit: torch.Tensor) -> torch.Tensor:
        return torch.round(unit * self.top).clamp_(-self.top, self.top).to(torch.int8).view(torch.uint8)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.int8).float()


class Int4(_Blocks):
    """Symmetric int4: round(x / scale) in -7..7, stored as code + 8 in a nibble (0..15; 0 unused)."""

    name = "int4"
    bits = 4
    top = 7.0

    def _codes(self, unit: torch.Tensor) -> torch.Tensor:
        return (torch.round(unit * self.top).clamp_(-self.top, self.top) + 8).to(torch.uint8)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.float() - 8


class Fp4E3M0(_Blocks):
    """1 sign bit and a 3-bit exponent e: e = 0 is zero, e = 1..7 is 2^(e - 7) of the block's scale. A
    magnitude m in [2^(k-1), 2^k) goes to the nearer of the two (2^k from 0.75 * 2^k up), below 2^-7 to 0."""

    name = "fp4_e3m0"
    bits = 4
    linear = False

    def _codes(self, unit: torch.Tensor) -> torch.Tensor:
        mantissa, exponent = torch.frexp(unit.abs())  # |u| = mantissa * 2^exponent, mantissa in [0.5, 1)
        level = torch.where(mantissa >= 0.75, exponent, exponent - 1).clamp_(max=0)  # 2^level, level <= 0
        # from 2^-7 (half way between 0 and the smallest level, 2^-6) up: at least the smallest level
        code = torch.where(unit.abs() >= 2.0**-7, (level + 7).clamp_(min=1), torch.zeros_like(level))
        return (code + 8 * (unit < 0)).to(torch.uint8)

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        exponent = (codes & 7).float()
        magnitude = torch.where(exponent > 0, torch.exp2(exponent - 7), torch.zeros_like(exponent))
        return torch.where(codes >= 8, -magnitude, magnitude)


_QUANTIZED: dict[str, type[_Blocks]] = {cls.name: cls for cls in (Int8, Int4, Fp4E3M0)}
_CASTS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def codec_for(delta_dtype: torch.dtype | str | None) -> Codec:
    """The codec of a SyncPolicy.delta_dtype: None or a float dtype (a cast), or a quantized format's name."""
    if delta_dtype is None:
        return Codec()
    if isinstance(delta_dtype, torch.dtype) and delta_dtype in _CASTS:
        return Codec(delta_dtype, _CASTS[delta_dtype])
    if isinstance(delta_dtype, str) and delta_dtype in _QUANTIZED:
        return _QUANTIZED[delta_dtype]()
    raise ConfigError(
        "SyncPolicy.delta_dtype must be None, torch.float32, torch.bfloat16, torch.float16 or one of "
        f"{', '.join(map(repr, QUANTIZED_SYNC_DTYPES))}; got {delta_dtype!r}"
    )


def for_values(codec: Codec) -> Codec:
    """The codec for values that are not outer gradients (floating buffers): float32 where `codec` quantizes."""
    return Codec() if codec.quantized else codec


def wire_name(delta_dtype: torch.dtype | str | None) -> str:
    """The sync_dtype name (fit's, the plan's) of a SyncPolicy.delta_dtype."""
    return codec_for(delta_dtype).name


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte: value 2i in the low nibble, 2i + 1 in the high one (an odd count: 0 pads)."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:numel]


def _non_finite(wire: str, flat: torch.Tensor, names: Sequence[str], sizes: Sequence[int]) -> str:
    bad = (~torch.isfinite(flat)).nonzero()
    first = int(bad[0]) if bad.numel() else 0
    where = f"value {first} of the {flat.numel()} sent"
    offset = 0
    for name, size in zip(names, sizes):
        if first < offset + size:
            where = f"parameter {name!r} (value {first - offset} of its {size})"
            break
        offset += size
    rank = f"[rank {dist.get_rank()}/{dist.get_world_size()}] " if dist.is_initialized() else ""
    return (
        f"{rank}outer sync in {wire}: this rank's outer gradient holds {bad.numel()} inf/NaN value(s), the first in "
        f"{where}; a quantized wire cannot carry them. The replica diverged between syncs: lower the (inner) "
        "learning rate or sync_every, or clip gradients (clip_grad_norm)"
    )
