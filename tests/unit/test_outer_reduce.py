"""The quantized outer sync's reduce-scatter (engine/outer_reduce.py), without processes: which means take
it, how the values are cut into the ranks' chunks, and the bytes a rank hands to its two collectives."""

from __future__ import annotations

import pytest
import torch

from lockstep.engine.outer_codec import BLOCK, codec_for
from lockstep.engine.outer_reduce import chunk_bounds, scatter_bytes, scatters


def test_quantized_means_over_3_ranks_or_more_scatter_and_the_others_do_not() -> None:
    for wire in ("int8", "int4", "fp4_e3m0"):
        assert (
            not scatters(codec_for(wire), 2) and scatters(codec_for(wire), 3) and scatters(codec_for(wire), 8)
        )
    for cast in (None, torch.bfloat16, torch.float16):
        assert not scatters(codec_for(cast), 4)


@pytest.mark.parametrize("numel", [1, 72, 127, 128, 129, 1809, 4 * 128, 4 * 128 + 1, 100_000])
@pytest.mark.parametrize("world", [3, 4, 8])
def test_chunks_are_whole_blocks_in_order_covering_every_value(numel: int, world: int) -> None:
    bounds = chunk_bounds(numel, world)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in rank order
    blocks = [-(-(stop - start) // BLOCK) for start, stop in bounds]
    assert max(blocks) - min(blocks) <= 1  # as even as whole blocks allow
    assert all(start % BLOCK == 0 for start, _ in bounds)  # each starts on a block: the same scales as whole
    assert all(stop % BLOCK == 0 for _, stop in bounds[:-1] if stop < numel)


def test_fewer_blocks_than_ranks_leave_some_chunks_empty() -> None:
    assert chunk_bounds(72, 3) == [(0, 0), (0, 0), (0, 72)]
    assert chunk_bounds(300, 4) == [(0, 0), (0, 128), (128, 256), (256, 300)]
    assert chunk_bounds(200, 4) == [(0, 0), (0, 128), (128, 128), (128, 200)]
    assert chunk_bounds(1809, 4) == [(0, 384), (384, 896), (896, 1408), (1408, 1809)]


def test_a_rank_hands_its_chunks_then_its_padded_mean_chunk() -> None:
    # int8, 1,809 values over 4 ranks: chunks of 3, 4, 4 and 4 (partial) blocks
    payloads = [4 * 3 + 384, 4 * 4 + 512, 4 * 4 + 512, 4 * 4 + 401]
    assert scatter_bytes(codec_for("int8"), 1809, 4) == sum(payloads) + max(payloads)
    # the TinyGPT of the benchmarks: about p (1 + 1 / W)
    n, codec = 3_200_512, codec_for("int4")
    assert abs(scatter_bytes(codec, n, 4) / (codec.payload_bytes(n) * 1.25) - 1) < 1e-4
