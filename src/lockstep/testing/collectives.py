"""See every tensor handed to `dist.all_reduce` / `dist.all_gather`: how tests and benchmarks count bytes.

A pass-through: the real collective runs with the same arguments. Hooks call these module attributes
(torch's own C++ reducer calls no Python collective, so its traffic is not seen here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


@contextmanager
def watch_collectives(on_tensor: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `on_tensor(tensor)` for each tensor passed to all_reduce / all_gather inside the block."""
    real_reduce, real_gather = dist.all_reduce, dist.all_gather

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on_tensor(tensor)
        return real_reduce(tensor, *args, **kwargs)

    def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on_tensor(tensor)
        return real_gather(out, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_reduce, dist.all_gather = real_reduce, real_gather  # type: ignore[assignment]
