"""Send a training state (nested state dicts) from one rank to the others over the process group.

Live mode's replacements heal from a peer this way (runtime/membership/recovery.py): no checkpoint
file, and no pickle. The structure travels as JSON (every dict, list, tuple, str, number, bool and None
is tagged so that it comes back as the same type, int dict keys included: optimizer state is keyed by
parameter index) and the tensors as one byte buffer, cut apart by the dtypes and shapes the JSON lists.
A peer's bytes are data: decoding builds containers, numbers and tensors, never objects of other types.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import ConfigError, InternalError
from lockstep.runtime.collectives import broadcast_object, comm_device, get_rank
from lockstep.runtime.waits import tracked, wait_watching_membership

_SCALARS = (str, int, float, bool, type(None))


def split(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """(a JSON-able skeleton of `tree`, its tensors in skeleton order)."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node.detach())
            return {
                "t": len(tensors) - 1,
                "dtype": str(node.dtype).removeprefix("torch."),
                "shape": list(node.shape),
            }
        if isinstance(node, dict):
            return {"d": [[walk(k, f"{where} key"), walk(v, f"{where}[{k!r}]")] for k, v in node.items()]}
        if isinstance(node, list):
            return {"l": [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]}
        if isinstance(node, tuple):
            return {"u": [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]}
        if isinstance(node, _SCALARS):
            return {"v": node}
        raise ConfigError(
            f"the training state at {where} holds a {type(node).__name__}, which cannot be sent to a peer "
            "without pickle: state dicts may hold tensors, containers, strings, numbers, bools and None"
        )

    return walk(tree, "state"), tensors


def join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree that split() took apart."""
    if "t" in skeleton:
        return tensors[int(skeleton["t"])]
    if "d" in skeleton:
        return {join(k, tensors): join(v, tensors) for k, v in skeleton["d"]}
    if "l" in skeleton:
        return [join(v, tensors) for v in skeleton["l"]]
    if "u" in skeleton:
        return tuple(join(v, tensors) for v in skeleton["u"])
    value = skeleton["v"]
    if not isinstance(value, _SCALARS):
        raise InternalError(f"a state skeleton holds a {type(value).__name__} where a scalar belongs")
    return value


def _metas(skeleton: Any) -> list[tuple[torch.dtype, list[int]]]:
    found: dict[int, tuple[torch.dtype, list[int]]] = {}

    def walk(node: Any) -> None:
        if "t" in node:
            dtype = getattr(torch, str(node["dtype"]))
            if not isinstance(dtype, torch.dtype):
                raise InternalError(f"a state skeleton names {node['dtype']!r}, which is not a torch dtype")
            found[int(node["t"])] = (dtype, [int(n) for n in node["shape"]])
        for key in ("l", "u"):
            for child in node.get(key, ()):
                walk(child)
        for k, v in node.get("d", ()):
            walk(k)
            walk(v)

    walk(skeleton)
    return [found[i] for i in range(len(found))]


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel * dtype.itemsize


def broadcast_state(tree: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """`tree` from rank `src` on every rank of `group` (a collective: every rank calls it; `tree` is only
    read on `src`). Two broadcasts: the JSON skeleton, then every tensor's bytes in one buffer."""
    device = comm_device(group)
    sending = get_rank() == src
    skeleton, tensors = split(tree) if sending else (None, [])
    skeleton = broadcast_object(skeleton, src=src, group=group)
    metas = _metas(skeleton)
    sizes = [_nbytes(dtype, shape) for dtype, shape in metas]
    if sending:
        parts = [t.contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors]
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    else:
        payload = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    if payload.numel():
        with tracked("broadcast (training state)", (payload,), group, publish=True):
            wait_watching_membership(dist.broadcast(payload, src=src, group=group, async_op=True))
    if sending:
        return tree
    received, offset = [], 0
    for (dtype, shape), size in zip(metas, sizes):
        chunk = payload[offset : offset + size].clone()
        received.append(
            chunk.view(dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype, device=device)
        )
        offset += size
    return join(skeleton, received)
