"""Random number generator states (python, numpy, torch, cuda) as plain JSON, captured and restored per rank.

Every rank's streams matter for an exact resume (dropout, augmentation, DataLoader worker seeds), so
save() gathers each rank's state to rank 0, which writes them all into rng.json with the checkpoint.
A rank that did not exist when the checkpoint was written (resume at a larger world size) gets streams
seeded deterministically from (step, rank), with a warning: the run is reproducible but not identical.
"""

from __future__ import annotations

import base64
import hashlib
import random
from typing import Any

import numpy as np
import torch

RNG_VERSION = 1


def _pack(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unpack(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def capture() -> dict[str, Any]:
    """This process's generator states as JSON-serializable data."""
    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "version": RNG_VERSION,
        "python": [version, list(internal), gauss],
        "numpy": [
            kind,
            _pack(np.asarray(key, dtype=np.uint32).tobytes()),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": _pack(torch.get_rng_state().numpy().tobytes()),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_pack(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any]) -> None:
    """Set this process's generators to `state` (from capture()); CUDA devices beyond what exists are skipped."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.frombuffer(_unpack(key), dtype=np.uint32).copy(), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        for device, packed in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_bytes_tensor(packed), device)


def seed_new_rank(step: int, rank: int) -> int:
    """Seed every generator from (step, rank) for a rank the checkpoint has no state for; returns the seed."""
    seed = int.from_bytes(hashlib.sha256(f"lockstep-rng:{step}:{rank}".encode()).digest()[:4], "little")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device as well
    return seed


def _bytes_tensor(packed: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(_unpack(packed)), dtype=torch.uint8).clone()
