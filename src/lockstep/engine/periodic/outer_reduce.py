"""The mean of quantized outer gradients over W >= 3 ranks: a quantized reduce-scatter, then an all-gather.

A quantized mean over 2 ranks is one all-gather of each rank's payload p (engine/core/outer_codec.py): (W - 1) p
on the wire per rank, which saves the payload ratio 4n / p over float32's ring all-reduce (2 (W - 1) / W
* 4n) at W = 2 but only 8n / (W p) beyond (half of it at W = 4, nothing for int8 at W = 8). From W = 3
(`SCATTER_FROM_WORLD`) the mean takes two collectives instead, as torchft and Streaming DiLoCo do:

1. every rank cuts its flat float32 outer gradient into W chunks of whole 128-value blocks (the codec's
   BLOCK; `chunk_bounds`: the same cut on every rank, as even as whole blocks allow, the larger chunks
   first; the last chunk may end in a partial block, and with fewer blocks than ranks the last chunks
   are empty), encodes each
   chunk, and sends chunk j to rank j (one `all_to_all_single`: gloo sends each peer its chunk directly);
2. rank j decodes the W chunks j it received, sums them in float32 in rank order, divides by W and
   encodes that mean chunk again with the same codec; every rank all-gathers the encoded mean chunks
   (padded to the largest chunk's payload: gloo gathers equal sizes) and decodes all of them.

Every rank decodes the same bytes, so every rank gets the same bits, run after run (the sums' order is
fixed). On the wire per rank: (W - 1) / W * p in phase 1 and (W - 1) / W * p in phase 2 (a ring), about
2 (W - 1) / W * p: the saving over float32 is the payload ratio (int8 3.88x, 4 bits 7.53x) at any W. The
price: the mean is quantized a second time (its own scales, block by block), so the result differs
from the gather's (which quantizes each rank's values once, and stays in use at W = 2, where it already
reaches the payload ratio). comm_bytes counts the bytes a rank's inputs send to other ranks, each once,
as for every mode (an all-reduce's 4n, a gather's p): the W - 1 encoded chunks of the others (its own
stays) and its padded mean chunk, about p (W - 1) / W + p / W = p (`sent_bytes`; ranks differ by at most
a chunk). So comm_bytes vs float32's 4n is the payload ratio, as on the wire.

The second collective needs the first one's answer. Both are launched when the mean is (on every rank
at the same point): phase 1 is waited for there, phase 2 is left in flight, and `result()` only waits for
it. So streaming DiLoCo's overlap (fragment_delay) covers phase 2; phase 1, about half the bytes, is
waited for at the fragment's sync. Launching phase 2 later (at the next inner step, or in `result()`)
would overlap both, but `result()` is also called by one rank alone (rank 0 writing a checkpoint waits
for the means in flight, engine/periodic/outer_sync.py): a collective launched there would be rank 0's alone, and
mismatch its peers' next one. Both collectives are numbered for the hang watchdog (op "outer sync
(all_to_all)", then "outer sync (all_gather)").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.core.outer_codec import BLOCK, Codec, NonFiniteOuterGradient
from lockstep.errors import InternalError
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import tracked, wait_tracked, wait_watching_membership

SCATTER_FROM_WORLD = 3  # below, the one all-gather already saves the payload ratio and quantizes once


def scatters(codec: Codec, world: int) -> bool:
    """True when a mean in `codec` over `world` ranks takes the reduce-scatter (module doc)."""
    return codec.quantized and world >= SCATTER_FROM_WORLD


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """The values [start, stop) of rank j's chunk, for j in 0..world-1: whole BLOCKs, dealt as evenly as
    whole blocks allow, the larger chunks first (the last non-empty chunk ends at `numel`; with fewer
    blocks than ranks, the last chunks are empty)."""
    blocks = -(-numel // BLOCK)
    each, extra = divmod(blocks, world)  # the first `extra` chunks take one block more
    edges = [j * each + min(j, extra) for j in range(world + 1)]
    return [(min(numel, a * BLOCK), min(numel, b * BLOCK)) for a, b in zip(edges, edges[1:])]


def sent_bytes(codec: Codec, numel: int, world: int, rank: int) -> int:
    """The bytes rank `rank` sends to the others in a mean of `numel` values (what comm_bytes counts): the
    encoded chunks of the W - 1 other ranks, then its mean chunk padded to the largest chunk's payload."""
    sizes = [codec.payload_bytes(stop - start) for start, stop in chunk_bounds(numel, world)]
    return sum(sizes) - sizes[rank] + max(sizes)


class ScatteredMean:
    """One mean in two collectives (module doc): made, it runs phase 1 (waited for) and launches phase 2;
    `result()` waits for phase 2 and is the float32 mean. `sent`: the bytes sent to the other ranks."""

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
        self.bounds = chunk_bounds(flat.numel(), world)
        self.payload = [codec.payload_bytes(stop - start) for start, stop in self.bounds]
        received = self._scatter(flat, dist.get_rank(group), names, sizes)
        padded = self._mean_chunk(received, dist.get_rank(group))
        self.parts: list[torch.Tensor] | None = [torch.empty_like(padded) for _ in range(world)]
        self.record = PROGRESS.issue("outer sync (all_gather)", [padded], group)
        self.record.work = dist.all_gather(self.parts, padded, group=group, async_op=True)
        self.sent += padded.numel()

    def _scatter(
        self, flat: torch.Tensor, rank: int, names: Sequence[str], sizes: Sequence[int]
    ) -> torch.Tensor:
        """Phase 1: chunk j, encoded, to rank j; back, every rank's chunk `rank`, in rank order (waited)."""
        try:
            chunks = [self.codec.encode(flat[start:stop]) for start, stop in self.bounds]
        except NonFiniteOuterGradient:
            self.codec.encode(flat, names=names, sizes=sizes)  # raises again, naming the parameter and value
            raise
        send = torch.cat(chunks)
        mine = self.payload[rank]
        received = send.new_empty(self.world * mine)
        self.sent = send.numel() - mine  # its own chunk stays
        with tracked("outer sync (all_to_all)", [send], self.group):
            splits = {"output_split_sizes": [mine] * self.world, "input_split_sizes": self.payload}
            work = dist.all_to_all_single(received, send, **splits, group=self.group, async_op=True)
            wait_watching_membership(work)  # live mode: gives up when a member is lost
        return received

    def _mean_chunk(self, received: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's chunk of the mean: decoded, summed in rank order in float32, / W, encoded again and
        padded to the largest chunk's payload (gloo gathers equal sizes)."""
        start, stop = self.bounds[rank]
        count, size = stop - start, self.payload[rank]
        # rank i's chunk in row i (no values: empty rows); a copy each, for the float32 scales' alignment
        pieces = [row.clone() for row in received.view(self.world, size)]
        mean = self.codec.decode(pieces[0], count)
        for piece in pieces[1:]:  # in rank order: the same bits on every rank and in every run
            mean += self.codec.decode(piece, count)
        mean.div_(self.world)
        encoded = self.codec.encode(mean)
        return torch.nn.functional.pad(encoded, (0, max(self.payload) - encoded.numel()))

    def result(self) -> torch.Tensor:
        """The mean (float32, flat): wait for phase 2 (a wait only: a rank may call it alone), decode every
        mean chunk."""
        if self.parts is None:
            raise InternalError("ScatteredMean.result() called twice: the mean was taken already")
        wait_tracked(self.record, self.record.work)
        means = [
            self.codec.decode(part[:size], stop - start)
            for part, size, (start, stop) in zip(self.parts, self.payload, self.bounds)
        ]
        self.parts = None
        return torch.cat(means)
