"""`model.reducer` and the logging keys frameworks read (issue 37): torch's results, on lockstep's engine.

Lightning's manual optimization arms the reducer itself (`_rebuild_buckets()`, `prepare_for_backward`),
Accelerate's trigger_sync_in_backward calls `prepare_for_backward([])` after no_sync forwards, and
Lightning reads `can_set_static_graph` at teardown. Each pattern runs on torch's DDP and on lockstep's,
from the same weights and data: the parameters end bitwise equal and the logging keys agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lockstep
from lockstep.errors import TorchInternalAttributeError
from lockstep.testing import run_distributed

KINDS = {"torch": torch.nn.parallel.DistributedDataParallel, "lockstep": lockstep.DistributedDataParallel}


class Branchy(nn.Module):
    """Uses `b` only when asked: the set of unused parameters can change from one forward to the next."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)
        self.head = nn.Linear(6, 3)
        self.wrapper: Any = None  # set to the DDP wrapper to imitate Lightning's forward redirection

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.relu(self.a(x))
        out = self.b(h) + self.head(h) if use_b else self.head(h)
        if self.wrapper is not None:  # Lightning's on_after_inner_forward in manual optimization
            self.wrapper.require_backward_grad_sync = False
        return out


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)


def _wrap(kind: str, **kwargs: Any) -> tuple[nn.Module, Branchy]:
    torch.manual_seed(0)
    module = Branchy()
    return KINDS[kind](module, **kwargs), module


def _manual_optimization(kind: str) -> list[torch.Tensor]:
    """Lightning's manual_backward: the forward leaves the reducer unarmed, the strategy arms it."""
    ddp, module = _wrap(kind)
    module.wrapper = ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(5):
        x, y = _data(step)
        loss = F.cross_entropy(ddp(x), y)
        ddp.require_backward_grad_sync = True  # on_after_outer_forward
        ddp.require_forward_param_sync = True
        ddp.reducer._rebuild_buckets()
        ddp.reducer.prepare_for_backward([loss])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]


def _trigger_sync_in_backward(kind: str) -> list[torch.Tensor]:
    """Accelerate's pattern: forwards under no_sync, then the last backward is synced by hand."""
    ddp, _ = _wrap(kind)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        losses = []
        for micro in range(2):
            x, y = _data(10 * step + micro)
            with ddp.no_sync():
                losses.append(F.cross_entropy(ddp(x), y))
        losses[0].backward()
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
        losses[1].backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]


def _logging_keys(kind: str, *, hook: bool, vary: bool) -> dict[str, Any]:
    ddp, _ = _wrap(kind, find_unused_parameters=True)
    if hook:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    seen = []
    for step in range(4):
        x, y = _data(step)
        F.cross_entropy(ddp(x, use_b=not (vary and step == 2)), y).backward()
        data = ddp._get_ddp_logging_data()
        seen.append({key: data[key] for key in ("comm_hook", "can_set_static_graph") if key in data})
    return {"seen": seen, "graph_static": ddp.reducer._ddp_graph_static()}


def _patterns() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        out[f"manual {kind}"] = _manual_optimization(kind)
        out[f"trigger {kind}"] = _trigger_sync_in_backward(kind)
    return out


def _logging() -> dict[str, Any]:
    # torch logs can_set_static_graph once per process, for the first of its models to turn out dynamic
    # or to be destroyed: here the dynamic one runs first (lockstep logs per model)
    out: dict[str, Any] = {}
    for kind in ("torch", "lockstep"):
        for hook, vary in ((False, True), (True, False)):
            out[f"{kind} hook={hook} vary={vary}"] = _logging_keys(kind, hook=hook, vary=vary)
    ddp, _ = _wrap("lockstep")
    try:
        ddp.reducer._get_local_used_map()
    except TorchInternalAttributeError as error:
        out["internal"] = str(error)
    return out


def test_framework_calls_on_the_reducer_give_torchs_parameters() -> None:
    for res in run_distributed(_patterns, 2, timeout=90):
        for pattern in ("manual", "trigger"):
            ours, theirs = res[f"{pattern} lockstep"], res[f"{pattern} torch"]
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), pattern


@pytest.mark.fresh_ranks  # torch logs can_set_static_graph once per process: fresh processes
def test_logging_keys_match_torchs() -> None:
    for res in run_distributed(_logging, 2, timeout=90):
        for hook, vary in ((True, False), (False, True)):
            ours, theirs = res[f"lockstep hook={hook} vary={vary}"], res[f"torch hook={hook} vary={vary}"]
            assert ours == theirs, (ours, theirs)
            if vary:
                assert ours["seen"] == [{}, {}, {"can_set_static_graph": 0}, {"can_set_static_graph": 0}]
                assert ours["graph_static"] is False
            else:
                assert ours["seen"] == [{"comm_hook": "fp16_compress_hook"}] * 4
        assert "'_get_local_used_map'" in res["internal"] and "internal of torch's C++" in res["internal"]
