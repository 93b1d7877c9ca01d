"""A small data-parallel loop of our own, for tests/cli/test_stragglers.py: `CASE OUT STEPS`.

Every step: data loading inside `with lockstep.phase("data loading")`, a forward and backward through
lockstep.DistributedDataParallel, an optimizer step, and 10 ms of "compute" (so that a step is not all
noise on a loaded machine). CASE "slow": rank 1 sleeps 30 ms more in its data loading from step SLOW_FROM on;
"balanced": nobody does; "sharded_<case>": the same on a model cut by lockstep.shard (torch's FSDP2). Rank 0 polls lockstep.runtime.stragglers() after each step and records at which
step a report first appeared. Each rank writes OUT/result-<rank>.json at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

import lockstep
from lockstep.runtime import stragglers

CASE, OUT, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])
SHARDED = CASE.startswith("sharded_")  # the model cut by lockstep.shard (FSDP2) instead of replicated
CASE = CASE.removeprefix("sharded_")
SLOW_RANK, SLOW_FROM, SLOW_S = 1, 20, 0.030


def main() -> None:
    topo = lockstep.init()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    if SHARDED:
        lockstep.shard(module)
        model: nn.Module = module
    else:
        model = lockstep.DistributedDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    named_at = None
    for step in range(1, STEPS + 1):
        with lockstep.phase("data loading"):
            x, y = torch.randn(16, 32), torch.randn(16, 1)
            if CASE == "slow" and topo.rank == SLOW_RANK and step >= SLOW_FROM:
                time.sleep(SLOW_S)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.010)
        if named_at is None and stragglers():
            named_at = step
    result = {
        "rank": topo.rank,
        "named_at": named_at,
        "reports": [r.as_dict() for r in stragglers()],
    }
    with open(os.path.join(OUT, f"result-{topo.rank}.json"), "w") as f:
        json.dump(result, f)
    lockstep.shutdown()


if __name__ == "__main__":
    main()
