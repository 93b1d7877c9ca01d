"""The job that benchmarks/live_recovery.py runs under `lockstep run`: deterministic lockstep.fit of an MLP
whose parameters take MB megabytes (Adam: the state sent to a replacement is three times that).

argv: OUT MB STEPS KILL_STEP CHECKPOINT_EVERY [float]. With "float", not in deterministic mode. Launch rank 2 SIGKILLs itself in the forward of step
KILL_STEP (after writing the time to OUT/killed; once: a restarted rank 2 does not). Every process appends
"<time> <step>" to
OUT/steps-<launch rank>.txt when it completes a step (the step number comes from Adam's own count, so a
run restarted from a checkpoint numbers its steps right), and writes OUT/started-<launch rank> with the
time its interpreter reached this file's first line.
"""

from __future__ import annotations

import time

STARTED = time.time()

import os  # noqa: E402  (after the start time: the imports are part of a replacement's start-up)
import signal  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

import lockstep  # noqa: E402

OUT, MB, STEPS, KILL_STEP, CHECKPOINT_EVERY = sys.argv[1], *map(int, sys.argv[2:6])
FLOAT = sys.argv[6:] == ["float"]
UID = int(os.environ.get("LOCKSTEP_MEMBER_ID", os.environ["RANK"]))
WIDTH, GLOBAL_BATCH, MICRO_BATCH = 1024, 8, 2


class Features(Dataset):
    def __len__(self) -> int:
        return GLOBAL_BATCH * STEPS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))
        return x, x.roll(1)


def model() -> nn.Module:
    layers = max(1, MB * 2**20 // (4 * (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


class TimedAdam(torch.optim.Adam):
    def steps_done(self) -> int:
        first = self.param_groups[0]["params"][0]
        return int(self.state[first]["step"]) if "step" in self.state.get(first, {}) else 0

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        done = self.steps_done()
        result = super().step(closure)
        with open(os.path.join(OUT, f"steps-{UID}.txt"), "a") as fh:
            fh.write(f"{time.time()} {done + 1}\n")
        return result


OPTIMIZER: list[TimedAdam] = []


def make_optimizer(params: object) -> TimedAdam:
    OPTIMIZER.append(TimedAdam(params, lr=1e-4))  # type: ignore[arg-type]
    return OPTIMIZER[-1]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    killed = os.path.join(OUT, "killed")
    if UID == 2 and OPTIMIZER[-1].steps_done() + 1 == KILL_STEP and not os.path.exists(killed):
        _write("killed", f"{time.time()}")
        os.kill(os.getpid(), signal.SIGKILL)
    return nn.functional.mse_loss(out, target)


def _write(name: str, text: str) -> None:
    with open(os.path.join(OUT, name), "w") as fh:
        fh.write(text)


def main() -> None:
    _write(f"started-{UID}", f"{STARTED}")
    torch.manual_seed(0)
    config = lockstep.FitConfig(
        run_dir=os.path.join(OUT, "run"),
        epochs=1,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        deterministic=not FLOAT,
        checkpoint_every=CHECKPOINT_EVERY,
        log_every=1000,
        task="regression",
        progress="none",
    )
    lockstep.fit(
        model(),
        Features(),
        loss_fn=loss_fn,
        config=config,
        optimizer=make_optimizer,
    )
    lockstep.shutdown()


if __name__ == "__main__":
    main()
