"""A backward that raises: the next step averages as usual, or every later forward raises, never silence.

Two cases, as torch's DDP has them:
- the backward raised before any parameter's gradient arrived: nothing was reduced, so the next step
  trains and averages as usual (before the fix, the finalize callback that the raised backward dropped
  stayed counted as queued, and every later step left its gradients unaveraged, silently);
- it raised after the reduction began: collectives may have been issued on some ranks only, so every
  later synced forward raises torch's "Expected to have finished reduction in the prior iteration".
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from lockstep.testing import run_distributed


class _RaiseOnce(torch.autograd.Function):
    """Identity whose backward raises while `armed` is set."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _RaiseOnce.armed:
            raise RuntimeError("injected failure in backward")
        return grad


class _Net(nn.Module):
    """`where` says where the failing op sits: at the output (before any parameter's gradient) or
    between the two layers (after the second layer's gradients arrived)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "output":
            return _RaiseOnce.apply(self.b(self.a(x)))
        return self.b(_RaiseOnce.apply(self.a(x)))


def _wrap(kind: str, module: nn.Module) -> nn.Module:
    if kind == "torch":
        return TorchDDP(module)
    if kind == "ours":
        return lockstep.DistributedDataParallel(module)
    lockstep.replicate(module)
    return module


def _after_a_raised_backward(kind: str, where: str) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = _Net(where)
    model = _wrap(kind, module)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # settled buckets (and fast hooks) before the failure
        module.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
    _RaiseOnce.armed = True
    try:
        model(x).pow(2).sum().backward()
    except RuntimeError as exc:
        assert "injected failure" in str(exc)
    _RaiseOnce.armed = False
    out: dict[str, Any] = {"errors": []}
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        try:
            model(x).pow(2).sum().backward()
        except RuntimeError as exc:
            out["errors"].append(f"{type(exc).__name__}: {exc}")
            continue
        out["grads"] = [p.grad.clone() for p in module.parameters()]
    local = _Net(where)
    local.load_state_dict({k.removeprefix("module."): v for k, v in model.state_dict().items()})
    local(x).pow(2).sum().backward()
    grads = [p.grad.clone() for p in local.parameters()]
    for g in grads:
        dist.all_reduce(g)
    out["mean"] = [g / dist.get_world_size() for g in grads]
    return out


@pytest.mark.parametrize("kind", ["torch", "ours", "replicate"])
def test_a_backward_that_raised_before_any_gradient_leaves_the_next_steps_averaged(kind: str) -> None:
    for rank, out in enumerate(
        run_distributed(_after_a_raised_backward, 2, args=(kind, "output"), timeout=90)
    ):
        assert out["errors"] == [], f"{kind} rank {rank}: {out['errors']}"
        for got, mean in zip(out["grads"], out["mean"]):
            torch.testing.assert_close(got, mean, msg=f"{kind} rank {rank}: gradients not averaged")


@pytest.mark.parametrize("kind", ["torch", "ours", "replicate"])
def test_a_backward_that_raised_mid_reduction_makes_every_later_forward_raise(kind: str) -> None:
    for rank, out in enumerate(
        run_distributed(_after_a_raised_backward, 2, args=(kind, "middle"), timeout=90)
    ):
        assert len(out["errors"]) == 2, f"{kind} rank {rank}: a later step trained: {out['errors']}"
        for error in out["errors"]:
            assert "Expected to have finished reduction in the prior iteration" in error, error
            if kind != "torch":
                assert error.startswith(f"UsageError: [rank {rank}/2]"), error
