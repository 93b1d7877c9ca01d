"""See every tensor handed to `dist.all_reduce` / `all_gather` / `all_to_all_single`: how tests count bytes.

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
    """Call `on_tensor(tensor)` for each tensor passed to all_reduce / all_gather inside the block, and for
    the whole input of each all_to_all_single (the quantized outer sync's reduce-scatter at W >= 3,
    engine/periodic/outer_reduce.py: its own chunk included, which comm_bytes leaves out)."""
    real_reduce, real_gather, real_scatter = dist.all_reduce, dist.all_gather, dist.all_to_all_single

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on_tensor(tensor)
        return real_reduce(tensor, *args, **kwargs)

    def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on_tensor(tensor)
        return real_gather(out, tensor, *args, **kwargs)

    def all_to_all_single(out: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on_tensor(tensor)
        return real_scatter(out, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]
    dist.all_to_all_single = all_to_all_single  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_reduce, dist.all_gather = real_reduce, real_gather  # type: ignore[assignment]
        dist.all_to_all_single = real_scatter  # type: ignore[assignment]
