"""An Accelerate program, unmodified for lockstep: gradient accumulation over 2 micro-batches.

Run as `lockstep run -n 2 [--ddp lockstep] accelerate_program.py OUT`. Each rank writes
OUT/engine.rank<R>.txt (the module of the class that wrapped its model) and OUT/params.rank<R>.pt.
"""

import os
import sys

import torch
from accelerate import Accelerator
from torch import nn


def main() -> None:
    out = sys.argv[1]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    rank = accelerator.process_index
    with open(os.path.join(out, f"engine.rank{rank}.txt"), "w") as fh:
        fh.write(type(model).__module__)
    params = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    torch.save(params, os.path.join(out, f"params.rank{rank}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
