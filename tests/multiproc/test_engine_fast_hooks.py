"""Fast hooks (engine/buckets/reducer.py): C hooks for small gradients, one Python trigger per bucket.

The buckets must launch with the same bits as torch's DDP whatever the order in which gradients arrive,
including when that order changes from one step to the next (a trigger that is no longer the last one
of its bucket: the bucket launches later, never with a gradient missing).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.testing import run_distributed

STEPS = 8
WIDTH = 8


class Branches(nn.Module):
    """Two stacks of small layers; `flip` computes them in the other order, which reverses the order in
    which autograd accumulates their gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))
        self.b = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))
        self.flip = False

    def _stack(self, layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = x + torch.tanh(layer(x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flip:
            yb = self._stack(self.b, x)
            ya = self._stack(self.a, x)
        else:
            ya = self._stack(self.a, x)
            yb = self._stack(self.b, x)
        return ya * yb


def _train(cls: Any, flips: list[bool], accumulate_at: set[int]) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = Branches()
    model = cls(module, bucket_cap_mb=0.001)  # 1 KB: several buckets of a few layers each
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    grads, triggers, fast = [], [], []
    for step, flip in enumerate(flips):
        module.flip = flip
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * rank + step))
        # nanoGPT's accumulation by flag: these backwards keep local gradients
        model.require_backward_grad_sync = step not in accumulate_at
        model(x).square().mean().backward()
        if step in accumulate_at:
            continue
        grads.append([p.grad.clone() for p in module.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cls is lockstep.DistributedDataParallel:
            reducer = model._replica.reducer
            triggers.append([b.last_ready for b in reducer.buckets])
            fast.append((sum(reducer._fast), len(reducer.buckets)))
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in module.parameters()],
        "triggers": triggers,
        "fast": fast,
    }


def _both(flips: list[bool], accumulate_at: set[int]) -> dict[str, Any]:
    ours = _train(lockstep.DistributedDataParallel, flips, accumulate_at)
    theirs = _train(torch.nn.parallel.DistributedDataParallel, flips, accumulate_at)
    for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
        for i, (ga, gb) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(ga, gb), (
                f"rank {dist.get_rank()} synced step {step} param {i}: not torch's bits"
            )
    for pa, pb in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(pa, pb)
    return {"triggers": ours["triggers"], "fast": ours["fast"]}


def test_fast_hooks_engage_and_keep_torchs_bits() -> None:
    flips = [False] * STEPS
    for out in run_distributed(_both, 2, args=(flips, {4, 5}), timeout=120):
        n_params = 24
        # from the step after the bucket rebuild on, every parameter but one per bucket has a C hook
        for fast, buckets in out["fast"][2:]:
            assert buckets > 2 and fast == n_params - buckets, out["fast"]


def test_a_changed_arrival_order_launches_later_never_wrong() -> None:
    # step 5, an accumulation step, changes the order: what its hooks reported after the last trigger
    # must count as local (drained before the next synced forward arms), not as ready in step 6, whose
    # order differs from the triggers' too
    flips = [step in (2, 5, 6, 9) for step in range(STEPS + 3)]
    for out in run_distributed(_both, 2, args=(flips, {5}), timeout=120):
        later = out["triggers"][2:]
        assert any(t != later[0] for t in later), f"the triggers never changed: {out['triggers']}"
