"""The drop-in class gives torch's gradients bit for bit at world sizes 3 and 4, not just 2.

At world 2 a sum of two values does not depend on their order; from 3 ranks on, gloo's ring all-reduce
sums each element in an order that depends on where the element falls in its bucket (the ring splits a
bucket into one chunk per rank). So the drop-in class must lay its buckets out exactly as torch's DDP
does, in the first step (one bucket, or torch's 1 MiB / 25 MiB split under find_unused_parameters) and
after the rebuild in the observed ready order. Each case trains lockstep's class and torch's from the
same weights on the same per-rank batches, and asserts equal gradients after every step, equal final
parameters, and torch's bucket layout as torch's own logging reports it.

Starting ranks costs more than the checks, so one launch runs every case.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from lockstep.testing import run_distributed

STEPS = 3  # the rebuild happens before the second step's forward; the third runs on the rebuilt buckets
LAYOUT_KEYS = ("bucket_sizes", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices")


class Wide(nn.Module):
    """About 6 MB of gradients: more than torch's 1 MiB first bucket, so the layout has several buckets.

    `branch` is used only where `use_branch` is set (per rank under find_unused_parameters);
    `mixed` puts a float64 layer in the middle (buckets never mix dtypes).
    """

    def __init__(self, mixed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 1100)
        self.mid = nn.Linear(1100, 1000, dtype=torch.float64 if mixed else torch.float32)
        self.branch = nn.Linear(1000, 1000)
        self.out = nn.Linear(1000, 300)
        self.head = nn.Linear(300, 7)
        self.use_branch = True

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.mid(h.to(self.mid.weight.dtype))).float()
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(torch.relu(self.out(h)))


class SparseAndDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5000, 64, sparse=True)
        self.dense = nn.Embedding(3000, 128)
        self.fc = nn.Linear(192, 500)
        self.head = nn.Linear(500, 7)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.cat([self.emb(x[:, 0]), self.dense(x[:, 1] % 3000)], dim=1)
        return self.head(torch.relu(self.fc(h)))


def _inputs(model: nn.Module, rank: int, step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    if isinstance(model, SparseAndDense):
        x = torch.randint(0, 5000, (16, 2), generator=gen)
    else:
        x = torch.randn(16, 64, generator=gen)
    return x, torch.randint(0, 7, (16,), generator=gen)


def _train(
    kind: str, factory: Callable[[], nn.Module], kwargs: dict[str, Any], prepare: Callable[[Any, int], None]
) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different weights per rank: the wrap must broadcast rank 0's
    module = factory()
    cls = lockstep.DistributedDataParallel if kind == "ours" else TorchDDP
    ddp = cls(module, **kwargs)
    prepare(ddp, rank)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    grads = []
    for step in range(STEPS):
        x, y = _inputs(module, rank, step)
        F.cross_entropy(ddp(x), y).backward()
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in module.parameters()])
        opt.step()
        opt.zero_grad()
    logged = ddp._get_ddp_logging_data()
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in module.parameters()],
        "layout": {k: logged[k] for k in LAYOUT_KEYS if k in logged},
    }


def _nothing(ddp: Any, rank: int) -> None:
    return None


def _branch_off_on_rank_1(ddp: Any, rank: int) -> None:
    ddp.module.use_branch = rank != 1  # locally unused on one rank: all-reduced anyway


def _static_after_wrap(ddp: Any, rank: int) -> None:
    ddp._set_static_graph()


def _allreduce_hook(ddp: Any, rank: int) -> None:
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # torch's hook sees torch's buckets


CASES: dict[str, tuple[Callable[[], nn.Module], dict[str, Any], Callable[[Any, int], None]]] = {
    "default": (Wide, {}, _nothing),
    "find_unused, a branch unused on rank 1": (Wide, {"find_unused_parameters": True}, _branch_off_on_rank_1),
    "static_graph": (Wide, {"static_graph": True}, _nothing),
    "_set_static_graph() with find_unused": (Wide, {"find_unused_parameters": True}, _static_after_wrap),
    "bucket_cap_mb=1, gradient_as_bucket_view": (
        Wide,
        {"bucket_cap_mb": 1, "gradient_as_bucket_view": True},
        _nothing,
    ),
    "float64 and float32 parameters": (lambda: Wide(mixed=True), {}, _nothing),
    "sparse and dense embeddings": (SparseAndDense, {}, _nothing),
    "torch's allreduce_hook": (Wide, {}, _allreduce_hook),
}


def _differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    found = []
    pairs = [
        (f"grad step {s} param {i}", a, b)
        for s, (ga, gb) in enumerate(zip(ours["grads"], theirs["grads"]))
        for i, (a, b) in enumerate(zip(ga, gb))
    ]
    pairs += [(f"final param {i}", a, b) for i, (a, b) in enumerate(zip(ours["params"], theirs["params"]))]
    for what, a, b in pairs:
        if a is None or b is None:
            if (a is None) != (b is None):
                found.append(f"{what}: None on one side only")
            continue
        if a.is_sparse:
            a, b = a.coalesce().to_dense(), b.coalesce().to_dense()
        if not torch.equal(a, b):
            found.append(
                f"{what}: {int((a != b).sum())} of {a.numel()} elements differ, "
                f"max {float((a - b).abs().max()):.3g}"
            )
    # torch logs the rebuilt layout at its own pace (under static_graph not by the third step): compare the
    # keys torch has logged (the gradients above are the real check of the layout)
    logged = {k: ours["layout"].get(k) for k in theirs["layout"]}
    if logged != theirs["layout"] or "bucket_sizes" not in logged:
        found.append(f"bucket layout {ours['layout']} vs torch's {theirs['layout']}")
    return found


def _all_cases() -> dict[str, list[str]]:
    report = {}
    for name, (factory, kwargs, prepare) in CASES.items():
        ours = _train("ours", factory, kwargs, prepare)
        theirs = _train("torch", factory, kwargs, prepare)
        report[name] = _differences(ours, theirs)
    return report


@pytest.mark.parametrize("world", [3, 4])
def test_gradients_and_bucket_layout_equal_torchs_at_world_3_and_4(world: int) -> None:
    reports = run_distributed(_all_cases, world, timeout=240)
    for rank, report in enumerate(reports):
        assert set(report) == set(CASES)
        bad = {name: found[:4] for name, found in report.items() if found}
        assert not bad, f"rank {rank} of {world}: lockstep differs from torch's DDP: {bad}"
