"""Exact evaluation on 3 gloo ranks: no padded duplicates, empty shards, metrics equal to one process."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep.data import EvalSampler, gather_eval, reduce_eval
from lockstep.errors import CollectiveMismatchError
from lockstep.runtime import get_rank
from lockstep.testing import run_distributed


def _setup(size: int) -> tuple[nn.Module, TensorDataset]:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(size, 4, generator=gen), torch.randint(0, 3, (size,), generator=gen)
    torch.manual_seed(0)
    return nn.Linear(4, 3), TensorDataset(x, y)


@torch.no_grad()
def _evaluate(
    model: nn.Module, loader: DataLoader[Any]
) -> tuple[dict[str, float | int], list[torch.Tensor], list[torch.Tensor]]:
    sums: dict[str, float | int] = {"correct": 0, "count": 0, "loss_sum": 0.0}
    preds, logits = [], []
    for x, y in loader:
        out = model(x)
        sums["correct"] += int((out.argmax(1) == y).sum())
        sums["count"] += len(y)
        sums["loss_sum"] += float(nn.functional.cross_entropy(out, y, reduction="sum"))
        preds.append(out.argmax(1))
        logits.append(out)
    return sums, preds, logits


def _sharded(size: int) -> dict[str, Any]:
    model, data = _setup(size)
    sampler = EvalSampler(data)
    sums, preds, logits = _evaluate(model, DataLoader(data, batch_size=3, sampler=sampler))
    totals = reduce_eval(sums)
    rows = sampler.gather({"pred": preds, "logits": logits})
    by_index = gather_eval(preds, indices=[torch.tensor(sampler.indices())], num_samples=size)
    return {
        "shard": len(sampler),
        "totals": totals,
        "pred": rows["pred"],
        "logits": rows["logits"],
        "by_index": by_index,
    }


def _mismatch() -> str:
    try:
        reduce_eval({"correct": 1} if get_rank() != 1 else {"right": 1})
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def _all_cases() -> tuple[list[dict[str, Any]], str]:
    return [_sharded(size) for size in (10, 2)], _mismatch()


def test_exact_metrics_on_three_ranks_and_a_mismatch_that_raises_instead_of_hanging() -> None:
    results = run_distributed(_all_cases, 3, timeout=90)
    _check_exact([cases for cases, _ in results])
    messages = [message for _, message in results]
    assert all("reduce_eval got names" in m and "from rank 1" in m for m in messages), messages


def _check_exact(out: list[list[dict[str, Any]]]) -> None:
    """Accuracy over 3 ranks equals single-process accuracy exactly, for 10 samples and for 2 (an empty rank)."""
    for case, size, shards in ((0, 10, [4, 3, 3]), (1, 2, [1, 1, 0])):
        model, data = _setup(size)
        sums, preds, logits = _evaluate(model, DataLoader(data, batch_size=size))
        single_accuracy = sums["correct"] / sums["count"]
        assert [rank[case]["shard"] for rank in out] == shards  # no padding, a rank may get nothing
        for rank in out:
            result = rank[case]
            assert result["totals"]["count"] == size
            assert result["totals"]["correct"] / result["totals"]["count"] == single_accuracy  # exactly
            assert abs(result["totals"]["loss_sum"] - sums["loss_sum"]) < 1e-5
            assert torch.equal(result["pred"], preds[0]) and torch.equal(result["by_index"], preds[0])
            torch.testing.assert_close(result["logits"], logits[0])
