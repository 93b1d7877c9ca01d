"""A Lightning program, unmodified for lockstep: strategy="ddp", automatic or manual optimization.

Run as `lockstep run -n 2 [--ddp lockstep] lightning_program.py OUT [--manual] [--strategy NAME | --static-graph]`, or as
`python lightning_program.py OUT --devices 2 [--use-lockstep-ddp]` (Lightning starts its own processes;
the parent becomes rank 0). Each rank writes OUT/engine.rank<R>.txt (the module of the class that
wrapped its model) and OUT/params.rank<R>.pt (its final parameters).
"""

import os
import sys

import torch
from torch import nn

if "--use-lockstep-ddp" in sys.argv:  # the documented way for a program that starts its own processes
    import lockstep

    lockstep.use_lockstep_ddp()

import lightning as L  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, out: str, manual: bool) -> None:
        super().__init__()
        self.out = out
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self) -> None:
        rank = self.global_rank
        with open(os.path.join(self.out, f"engine.rank{rank}.txt"), "w") as fh:
            fh.write(type(self.trainer.strategy.model).__module__)
        params = {k: v.detach().clone() for k, v in self.state_dict().items()}
        torch.save(params, os.path.join(self.out, f"params.rank{rank}.pt"))


def main() -> None:
    out = sys.argv[1]
    manual = "--manual" in sys.argv
    strategy = sys.argv[sys.argv.index("--strategy") + 1] if "--strategy" in sys.argv else "ddp"
    if "--static-graph" in sys.argv:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(static_graph=True)
    devices = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else None
    L.seed_everything(0)
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(out, manual), torch.utils.data.DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
