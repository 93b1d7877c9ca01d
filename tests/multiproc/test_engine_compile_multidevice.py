"""torch.compile'd modules (issue 3 item 9) and a replica spread over several devices (item 8, cpu in CI)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lockstep
from lockstep.testing import run_distributed
from lockstep.testing.parity import assert_tensors_close, run_parity, train_single
from tests.helpers import batch, build, case

STEPS = 2


def _compiled(where: str) -> dict:
    rank = dist.get_rank()
    out = {}
    for kind in ("ours", "torch"):
        module = build("mlp", rank)
        inner = torch.compile(module, backend="aot_eager") if where == "inner" else module
        cls = (
            lockstep.DistributedDataParallel if kind == "ours" else torch.nn.parallel.DistributedDataParallel
        )
        model = cls(inner)
        if where == "outer":
            model = torch.compile(model, backend="aot_eager")
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            x, y = batch(rank, step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[kind] = [p.detach().clone() for p in module.parameters()]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["inner", "outer"])
def test_compiled_module_matches_torch(where: str) -> None:
    out = run_distributed(_compiled, 2, args=(where,), timeout=120)
    single = train_single(case("mlp", STEPS), 2)
    for rank_out in out:
        assert_tensors_close(rank_out["ours"], rank_out["torch"], what=f"compile {where}")
        assert_tensors_close(rank_out["ours"], single.params, what="vs single")


def test_model_parallel_replica_on_cpu() -> None:
    run_parity({"toymp": case("toymp", STEPS)}, 2, timeout=60)
