"""The mean of quantized outer gradients over W >= 3 ranks: a quantized reduce-scatter, then an all-gather.

A quantized mean over 2 ranks is one all-gather of each rank's payload p (engine/outer_codec.py): (W - 1) p
on the wire per rank, which saves the payload ratio 4n / p over float32's ring all-reduce (2 (W - 1) / W
* 4n) at W = 2 but only 8n / (W p) beyond (half of it at W = 4, nothing for int8 at W = 8). From W = 3
(`SCATTER_FROM_WORLD`) the mean takes two collectives instead, as torchft and Streaming DiLoCo do:

1. every rank cuts its flat float32 outer gradient into W chunks of whole 128-value blocks (the codec's
   BLOCK; `chunk_bounds`: the same cut on every rank, as even as whole blocks allow, the last chunk may
   end in a partial block and chunks may be empty when there are fewer blocks than ranks), encodes each
   chunk, and sends chunk j to rank j (one `all_to_all_single`: gloo sends each peer its chunk directly);
2. rank j decodes the W chunks j it received, sums them in float32 in rank order, divides by W and
   encodes that mean chunk again with the same codec; every rank all-gathers the encoded mean chunks
   (padded to the largest chunk's payload: gloo gathers equal sizes) and decodes all of them.

Every rank decodes the same bytes, so every rank gets the same bits, run after run (the sums' order is
fixed). On the wire per rank: (W - 1) / W * p in phase 1 and (W - 1) / W * p in phase 2 (a ring), about
2 (W - 1) / W * p: the saving over float32 is the payload ratio (int8 3.88x, 4 bits 7.53x) at any W. The
price: the mean is quantized a second time (its own scales, block by block), so the result differs
from the gather's (which quantizes each rank's values once, and stays in use at W = 2, where it already
reaches the payload ratio). comm_bytes counts what this rank hands to the collectives, as for every
mode: its W encoded chunks (about p) and its padded mean chunk (about p / W).

The second collective needs the first one's answer: `ScatteredMean` launches phase 1 when it is made,
phase 2 in `advance()` (which waits for phase 1) and waits for phase 2 in `result()`. OuterSync advances
the means in flight at the next inner step (engine/outer_sync.py), so that with streaming DiLoCo's
fragment_delay >= 2 both phases overlap inner steps; with fragment_delay = 1 phase 2 is launched and
waited for when the mean is due, and only phase 1 overlaps. Both collectives are numbered for the hang
watchdog (op "outer sync (all_to_all)", then "outer sync (all_gather)"), on every rank in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.outer_codec import BLOCK, Codec, NonFiniteOuterGradient
from lockstep.errors import InternalError
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import wait_tracked

SCATTER_FROM_WORLD = 3  # below, the one all-gather already saves the payload ratio and quantizes once


def scatters(codec: Codec, world: int) -> bool:
    """True when a mean in `codec` over `world` ranks takes the reduce-scatter (module doc)."""
    return codec.quantized and world >= SCATTER_FROM_WORLD


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """The values [start, stop) of rank j's chunk, for j in 0..world-1: whole BLOCKs, dealt as evenly as
    whole blocks allow (the last chunk ends at `numel`; with fewer blocks than ranks, some are empty)."""
    blocks = -(-numel // BLOCK)
    edges = [j * blocks // world for j in range(world + 1)]
    return [(min(numel, a * BLOCK), min(numel, b * BLOCK)) for a, b in zip(edges, edges[1:])]


def scatter_bytes(codec: Codec, numel: int, world: int) -> int:
    """The bytes one rank hands to the two collectives of a mean of `numel` values (what comm_bytes counts):
    its W encoded chunks, then its mean chunk padded to the largest chunk's payload."""
    sizes = [codec.payload_bytes(stop - start) for start, stop in chunk_bounds(numel, world)]
    return sum(sizes) + max(sizes)


class ScatteredMean:
    """One mean in two collectives (module doc): phase 1 is launched here, phase 2 by `advance()`, the
    float32 answer is `result()`. `handed`: the bytes phase 1 handed to its collective."""

    def __init__(
        self,
        flat: torch.Tensor,
        codec: Codec,
        group: Any,
        world: int,
        *,
        names: Sequence[str] = (),
        sizes: Sequence[int] = (),
    ) -> None:
        self.codec, self.group, self.world = codec, group, world
        self.rank = dist.get_rank(group)
        self.bounds = chunk_bounds(flat.numel(), world)
        self.payload = [codec.payload_bytes(stop - start) for start, stop in self.bounds]
        try:
            chunks = [codec.encode(flat[start:stop]) for start, stop in self.bounds]
        except NonFiniteOuterGradient:
            codec.encode(flat, names=names, sizes=sizes)  # raises again, naming the parameter and value
            raise
        send = torch.cat(chunks)
        mine = self.payload[self.rank]
        self.received: torch.Tensor | None = send.new_empty(world * mine)
        self.parts: list[torch.Tensor] | None = None  # phase 2's gathered mean chunks, once launched
        self.record = PROGRESS.issue("outer sync (all_to_all)", [send], group)
        self.record.work = dist.all_to_all_single(
            self.received,
            send,
            output_split_sizes=[mine] * world,
            input_split_sizes=self.payload,
            group=group,
            async_op=True,
        )
        self.handed = send.numel()

    def advance(self) -> int:
        """Phase 2, once: wait for phase 1, take the mean of this rank's chunk (decoded, summed in rank
        order in float32, / W), encode it and launch the all-gather of the mean chunks. Returns the bytes
        handed to that collective (0 when it was launched before)."""
        if self.received is None:
            return 0
        wait_tracked(self.record, self.record.work)
        start, stop = self.bounds[self.rank]
        count, size = stop - start, self.payload[self.rank]
        # rank i's chunk in row i (no values: empty rows); a copy each, for the float32 scales' alignment
        pieces = [row.clone() for row in self.received.view(self.world, size)]
        mean = self.codec.decode(pieces[0], count)
        for piece in pieces[1:]:  # in rank order: the same bits on every rank and in every run
            mean += self.codec.decode(piece, count)
        mean.div_(self.world)
        encoded = self.codec.encode(mean)
        padded = torch.nn.functional.pad(encoded, (0, max(self.payload) - encoded.numel()))
        self.received = None
        self.parts = [torch.empty_like(padded) for _ in range(self.world)]
        self.record = PROGRESS.issue("outer sync (all_gather)", [padded], self.group)
        self.record.work = dist.all_gather(self.parts, padded, group=self.group, async_op=True)
        return padded.numel()

    def result(self) -> torch.Tensor:
        """The mean (float32, flat): wait for phase 2 (launched by `advance()`), decode every mean chunk."""
        if self.parts is None:
            raise InternalError("ScatteredMean.result() before advance(): phase 2 was never launched")
        wait_tracked(self.record, self.record.work)
        means = [
            self.codec.decode(part[:size], stop - start)
            for part, size, (start, stop) in zip(self.parts, self.payload, self.bounds)
        ]
        self.parts = None
        return torch.cat(means)
