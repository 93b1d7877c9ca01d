"""The quantized outer sync's reduce-scatter (engine/periodic/outer_reduce.py), without processes: which means take
it, how the values are cut into the ranks' chunks, and the bytes a rank hands to its two collectives."""

from __future__ import annotations

import pytest
import torch

from lockstep.engine.core.outer_codec import BLOCK, codec_for
from lockstep.engine.periodic.outer_reduce import chunk_bounds, scatters, sent_bytes


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
    filled = [(start, stop) for start, stop in bounds if stop > start]
    assert bounds[: len(filled)] == filled  # the empty chunks (fewer blocks than ranks) at the tail
    assert all(start % BLOCK == 0 for start, _ in filled)  # on block edges: the same scales as the whole
    assert all(stop % BLOCK == 0 for _, stop in filled if stop < numel)


def test_fewer_blocks_than_ranks_leave_some_chunks_empty() -> None:
    assert chunk_bounds(72, 3) == [(0, 72), (72, 72), (72, 72)]
    assert chunk_bounds(300, 4) == [(0, 128), (128, 256), (256, 300), (300, 300)]
    assert chunk_bounds(200, 4) == [(0, 128), (128, 200), (200, 200), (200, 200)]
    assert chunk_bounds(1809, 4) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1809)]


def test_a_rank_sends_the_others_chunks_then_its_padded_mean_chunk() -> None:
    # int8, 1,809 values over 4 ranks: chunks of 4, 4, 4 and 3 (the last partial) blocks
    payloads = [4 * 4 + 512, 4 * 4 + 512, 4 * 4 + 512, 4 * 3 + 273]
    for rank in range(4):
        assert sent_bytes(codec_for("int8"), 1809, 4, rank) == sum(payloads) - payloads[rank] + 528
    # the TinyGPT of the benchmarks: about the payload p, as the gather's comm_bytes
    n, codec = 3_200_512, codec_for("int4")
    assert abs(sent_bytes(codec, n, 4, 0) / codec.payload_bytes(n) - 1) < 1e-4
