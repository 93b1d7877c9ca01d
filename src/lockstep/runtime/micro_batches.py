"""Which rank computes which micro-batch of a step, and the random seed of each: pure, world-size aware.

Deterministic mode cuts every step into micro-batches of a fixed size; their ordinals 0..K-1 do not depend
on the world size, only their owners do. The engine (which micro-batch is 0, whose gradient sets the
fixed-point scale) and the data layer (which indices a rank loads) must agree on the owners: both use this.
"""

from __future__ import annotations

import hashlib

from lockstep.errors import ConfigError


def owned_micro_batches(num_micro_batches: int, world_size: int, rank: int) -> list[int]:
    """The ordinals rank `rank` computes: r, r + W, r + 2W, ... (round robin; rank 0 owns micro-batch 0).

    A rank may own none (more ranks than micro-batches): it still takes part in the step's reduction.
    """
    if num_micro_batches < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"owned_micro_batches({num_micro_batches!r}, world_size={world_size!r}, rank={rank!r}): "
            "expected num_micro_batches >= 0, world_size >= 1 and 0 <= rank < world_size"
        )
    return list(range(rank, num_micro_batches, world_size))


def micro_batch_seed(seed: int, step: int, ordinal: int) -> int:
    """The RNG seed of micro-batch `ordinal` of step `step`: a hash of the three, never of the rank.

    Dropout masks (and any other random number drawn in forward) then depend on which samples are in
    the micro-batch, not on which rank computed it. 63 bits: torch.manual_seed takes any int below 2**64.
    """
    digest = hashlib.blake2b(f"{seed}:{step}:{ordinal}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
