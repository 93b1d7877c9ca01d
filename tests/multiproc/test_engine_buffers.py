"""Buffers (issue 3 item 5): BatchNorm running stats broadcast from rank 0 before each training forward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.testing import run_distributed
from lockstep.testing.parity import run_parity
from tests.helpers import case

STEPS = 3


@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_torch(broadcast: bool) -> None:
    # BatchNorm's statistics are per rank: no single-process reference, torch's DDP is the oracle
    bn = case("convbn", STEPS, ddp_kwargs={"broadcast_buffers": broadcast}, single_process=False)
    out = run_parity({"convbn": bn}, 2)["convbn"]
    # each rank's stats = rank 0's before the last forward, updated with its own batch: they differ
    mean0, mean1 = out[0]["ours"].buffers[0], out[1]["ours"].buffers[0]
    assert (mean0 - mean1).abs().max() > 1e-4


class _Tally(nn.Module):
    """Buffers of two dtypes, one of them not contiguous, that each rank updates with its own values; the
    forward records the buffers it starts from (after the engine's broadcast)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("total", torch.zeros(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("strided", torch.zeros(4, 6)[:, ::2])
        self.seen: list[list[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append([b.clone() for b in self.buffers()])
        out = self.fc(x)
        with torch.no_grad():
            self.total += out.sum()
            self.count += x.shape[0]
            self.strided += x[:, :3].sum()
        return out


def _buffers_seen(engine: str) -> list[list[torch.Tensor]]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = _Tally()
    cls = (
        lockstep.DistributedDataParallel
        if engine == "lockstep"
        else torch.nn.parallel.DistributedDataParallel
    )
    model = cls(module)
    for step in range(5):
        if step == 2:  # a program reassigns a buffer (torch looks the buffers up before every forward)
            module.total = torch.full((5,), 10.0 * (rank + 1))  # another shape: another message layout
        x = torch.randn(2 + rank, 4, generator=torch.Generator().manual_seed(100 * rank + step))
        model(x).sum().backward()
    return [b for step in module.seen for b in step]


def test_buffer_broadcast_follows_torch_through_a_reassigned_buffer() -> None:
    out = run_distributed(_both_engines, 2, timeout=60)
    for rank, (ours, theirs) in enumerate(out):
        assert len(ours) == len(theirs) == 15
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}"
    # every forward starts from rank 0's buffers, the reassigned one included
    for a, b in zip(out[0][0], out[1][0]):
        assert torch.equal(a, b)
    assert torch.equal(out[1][0][6], torch.full((5,), 10.0))  # step 2's forward: rank 0's new buffer


def _both_engines() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return _buffers_seen("lockstep"), _buffers_seen("torch")


class _Scaled(nn.Module):
    """A buffer that the forward saves for backward (the product needs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def _two_forwards_one_backward() -> list[list[torch.Tensor]]:
    grads = []
    for cls in (lockstep.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        model = cls(_Scaled())
        model.module.scale.fill_(dist.get_rank() + 1.0)  # each rank its own value: the sync copies rank 0's
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(2):  # siamese steps: the second forward's buffer sync writes over a saved buffer
            a, b = model(torch.randn(2, 4, generator=gen)), model(torch.randn(2, 4, generator=gen))
            (a - b).square().sum().backward()
        grads.append([p.grad.clone() for p in model.module.parameters()])
    return grads


def test_two_forwards_then_one_backward_over_a_saved_buffer_like_torch() -> None:
    for ours, theirs in run_distributed(_two_forwards_one_backward, 2, timeout=60):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
