"""Combine per-rank evaluation results exactly: per-sample rows with their indices, or sums and counts.

Both helpers are collectives that every rank calls once, whatever the size of its shard (zero included):
the first exchange carries each rank's names, row counts, dtypes and shapes as JSON, so that unequal
shards never hang and a mismatch raises the same CollectiveMismatchError on every rank instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import CollectiveMismatchError, ConfigError, rank_tag
from lockstep.runtime import all_gather_object, get_rank, get_world_size
from lockstep.runtime.collectives import comm_device
from lockstep.runtime.waits import tracked

Rows = torch.Tensor | Sequence[torch.Tensor]
_INDEX = "\x00indices"  # the indices travel as one more named column


def gather_eval(
    values: Rows | Mapping[str, Rows], *, indices: Rows | None = None, num_samples: int | None = None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """All ranks' rows (dim 0 = samples) on every rank: in rank order, or in index order with `indices`.

    `values` is a tensor, a list of per-batch tensors (empty on a rank with no samples) or a dict of
    either. With `indices` (this rank's dataset indices, one per row) the rows come back sorted by
    index, and an index seen twice raises; with `num_samples` as well, every index in [0, num_samples)
    must be present exactly once. Metrics computed on the result equal the single-process ones.
    """
    single = not isinstance(values, Mapping)
    if isinstance(values, Mapping):
        local = {str(k): _rows(str(k), v) for k, v in values.items()}
    else:
        local = {"": _rows("values", values)}
    if indices is not None:
        index = _rows("indices", indices)
        local[_INDEX] = index.reshape(-1).to(torch.int64) if index is not None else None
    metas = all_gather_object({name: _meta(t) for name, t in local.items()})
    specs = _agree(metas)
    out = {name: _gather_rows(local[name], specs[name], [m[name]["rows"] for m in metas]) for name in local}
    if indices is not None:
        order = _index_order(out.pop(_INDEX), metas, num_samples)
        out = {name: rows[order] for name, rows in out.items()}
    return out[""] if single else out


def reduce_eval(sums: Mapping[str, float | int | bool | torch.Tensor]) -> dict[str, float | int]:
    """Sum each named scalar over ranks: ints exactly, floats correctly rounded (math.fsum); on every rank.

    Pass counts as ints (correct predictions, samples) so that ratios like accuracy are exactly the
    single-process ones; a rank with no samples passes zeros under the same names.
    """
    local = {str(name): _scalar(name, value) for name, value in sums.items()}
    gathered = all_gather_object(local)
    names = sorted(gathered[0])
    for rank, theirs in enumerate(gathered):
        if sorted(theirs) != names:
            raise CollectiveMismatchError(
                f"{_tag()}reduce_eval got names {names!r} from rank 0 but {sorted(theirs)!r} from rank {rank}; "
                "every rank must pass the same names (zeros on a rank with no samples)"
            )
    result: dict[str, float | int] = {}
    for name in names:
        parts = [theirs[name] for theirs in gathered]
        exact = all(isinstance(p, int) for p in parts)
        result[name] = sum(parts) if exact else math.fsum(float(p) for p in parts)
    return result


def _tag() -> str:
    world = get_world_size()
    return rank_tag(get_rank(), world) if world > 1 else ""


def _scalar(name: object, value: Any) -> float | int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"reduce_eval expects scalars; {name!r} has shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    raise ConfigError(
        f"reduce_eval expects int, float or one-element tensors; {name!r} is {type(value).__name__}"
    )


def _rows(name: str, value: Any) -> torch.Tensor | None:
    """One tensor of rows, or None for a rank that has none (its shape is then taken from the others)."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.dim() > 0 else value.detach().reshape(1)
    if isinstance(value, Sequence) and all(isinstance(v, torch.Tensor) for v in value):
        parts = [v.detach() if v.dim() > 0 else v.detach().reshape(1) for v in value]
        return torch.cat(parts) if parts else None
    raise ConfigError(
        f"gather_eval: {name} must be a tensor or a list of tensors, got {type(value).__name__}"
    )


def _meta(tensor: torch.Tensor | None) -> dict[str, Any]:
    if tensor is None or tensor.numel() == 0 and tensor.dim() == 1:
        return {"rows": 0, "shape": None, "dtype": None}
    return {"rows": int(tensor.shape[0]), "shape": list(tensor.shape[1:]), "dtype": str(tensor.dtype)}


def _agree(metas: list[dict[str, Any]]) -> dict[str, tuple[list[int], torch.dtype]]:
    """Names, trailing shapes and dtypes must match on every rank that has rows."""
    names = sorted(metas[0])
    specs: dict[str, tuple[list[int], torch.dtype]] = {}
    for rank, meta in enumerate(metas):
        if sorted(meta) != names:
            raise CollectiveMismatchError(
                f"{_tag()}gather_eval got names {_shown(names)} on rank 0 but {_shown(sorted(meta))} on rank {rank}; "
                "every rank must pass the same names (an empty list where it has no samples)"
            )
    for name in names:
        seen = [(rank, meta[name]) for rank, meta in enumerate(metas) if meta[name]["dtype"] is not None]
        for rank, meta in seen[1:]:
            if (meta["shape"], meta["dtype"]) != (seen[0][1]["shape"], seen[0][1]["dtype"]):
                raise CollectiveMismatchError(
                    f"{_tag()}gather_eval {_shown([name])}: rank {seen[0][0]} has rows of shape {seen[0][1]['shape']} "
                    f"{seen[0][1]['dtype']} but rank {rank} has {meta['shape']} {meta['dtype']}; every rank must "
                    "produce the same per-sample shape and dtype"
                )
        spec = (
            seen[0][1]
            if seen
            else {"shape": [], "dtype": "torch.int64" if name == _INDEX else "torch.float32"}
        )
        specs[name] = (spec["shape"], getattr(torch, spec["dtype"].split(".")[-1]))
    return specs


def _shown(names: list[str]) -> str:
    return repr(["indices" if n == _INDEX else n or "values" for n in names])


def _gather_rows(
    local: torch.Tensor | None, spec: tuple[list[int], torch.dtype], rows: list[int]
) -> torch.Tensor:
    shape, dtype = spec
    home = local.device if local is not None else torch.device("cpu")
    mine = local if local is not None and _meta(local)["rows"] else torch.empty(0, *shape, dtype=dtype)
    if len(rows) == 1 or not (dist.is_available() and dist.is_initialized()):
        return mine.to(home)
    wire = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool all_gather
    padded = torch.zeros(max(max(rows), 1), *shape, dtype=wire, device=comm_device())
    padded[: mine.shape[0]] = mine.to(padded.device, wire)
    gathered = [torch.empty_like(padded) for _ in rows]
    with tracked("allgather (evaluation outputs)", (padded,), None, publish=True):
        dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, rows)]).to(home, dtype)


def _index_order(index: torch.Tensor, metas: list[dict[str, Any]], num_samples: int | None) -> torch.Tensor:
    for rank, meta in enumerate(metas):
        counts = {name: m["rows"] for name, m in meta.items() if name != _INDEX}
        wrong = {name: n for name, n in counts.items() if n != meta[_INDEX]["rows"]}
        if wrong:
            raise ConfigError(
                f"{_tag()}gather_eval: rank {rank} passed {meta[_INDEX]['rows']} indices but rows {wrong!r}; "
                "pass one row per sample of the shard (did a DataLoader drop_last or a partial batch lose rows?)"
            )
    order = torch.argsort(index, stable=True)
    ordered = index[order]
    duplicates = ordered[1:][ordered[1:] == ordered[:-1]]
    if duplicates.numel():
        raise ConfigError(
            f"{_tag()}gather_eval: sample index {int(duplicates[0])} was evaluated more than once "
            f"({duplicates.numel()} duplicates): padded duplicates bias metrics; shard with lockstep.data.EvalSampler"
        )
    if num_samples is not None and not torch.equal(ordered, torch.arange(num_samples)):
        missing = sorted(set(range(num_samples)) - set(ordered.tolist()))[:10]
        raise ConfigError(
            f"{_tag()}gather_eval: expected every index of [0, {num_samples}) once, got {ordered.numel()} rows; "
            f"missing e.g. {missing!r}"
        )
    return order.to(index.device)
