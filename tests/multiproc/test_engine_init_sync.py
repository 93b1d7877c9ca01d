"""Wrap-time check and broadcast (issue 3 item 1): different models raise on every rank, naming rank and parameter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.errors import CollectiveMismatchError
from lockstep.testing import run_distributed


def _wrap_different(change: str) -> str:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    layers = [nn.Linear(4, 8), nn.Linear(8, 2)]
    if rank == 1 and change == "shape":
        layers[1] = nn.Linear(8, 3)
    if rank == 1 and change == "count":
        layers.append(nn.Linear(2, 2))
    if rank == 1 and change == "dtype":
        layers[0] = layers[0].double()
    try:
        lockstep.DistributedDataParallel(nn.Sequential(*layers))
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("shape", "rank 1: parameter '1.weight' has shape [3, 8], on rank 0 [2, 8]"),
        ("count", "rank 1: 6 parameters, rank 0: 4; the first extra one is '2.weight' on rank 1"),
        ("dtype", "rank 1: parameter '0.weight' has dtype float64, on rank 0 float32"),
    ],
)
def test_different_models_raise_on_every_rank(change: str, expected: str) -> None:
    out = run_distributed(_wrap_different, 2, args=(change,), timeout=60)
    for rank, message in enumerate(out):
        assert message.startswith(f"[rank {rank}/2]"), message
        assert expected in message, message


def _broadcast_from_group_rank0() -> list:
    # a subgroup of global ranks 1 and 2: its rank 0 is global rank 1, whose values must win
    group = dist.new_group([1, 2])
    rank = dist.get_rank()
    if rank == 0:
        return []
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(rank))
    ddp = lockstep.DistributedDataParallel(model, process_group=group)
    out = ddp(torch.randn(3, 4) + rank)
    out.sum().backward()
    return [t.detach().clone() for t in model.state_dict().values()] + [
        p.grad.clone() for p in model.parameters()
    ]


def test_process_group_subset_broadcasts_from_its_first_rank() -> None:
    out = run_distributed(_broadcast_from_group_rank0, 3, timeout=60)
    torch.manual_seed(1)
    expected = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert torch.equal(out[1][0], expected[0].weight.detach()) and torch.equal(out[2][0], out[1][0])
    # running_mean was broadcast (1.0 from global rank 1) before rank 2's own batch updated it
    assert (out[2][4] - 0.9).abs().max() < 0.5 and (out[2][4] - 1.8).abs().min() > 0.1
    for g1, g2 in zip(out[1][7:], out[2][7:]):  # gradients averaged within the group
        assert torch.equal(g1, g2)
