"""A small lockstep.fit run for tests/cli/test_live_launcher.py: what the live launcher does when a worker
raises, is killed, is interrupted, or is a replacement the job never needed.

argv: OUT_DIR EVENT... Each EVENT is `WHAT:MEMBER:STEP`: launch rank MEMBER (LOCKSTEP_MEMBER_ID) does
WHAT in its first forward once it has taken STEP optimizer steps in this process:

- `raise`: raises ValueError, only in the job's first attempt (it leaves OUT_DIR/raised-MEMBER, and a
  restarted job finds it there); `raise_runtime`: the same with a RuntimeError (the type gloo reports a
  lost peer with);
- `kill`: SIGKILLs itself.

A rank that raises writes the time (time.time()) into OUT_DIR/raised-MEMBER first.

`loop` as an EVENT: the same training through `lockstep.LiveLoop` (a loop of the program's own) instead of
`lockstep.fit`, with no checkpoints. `late` as an EVENT: a replacement (LOCKSTEP_LIVE_JOIN=1) waits until OUT_DIR/done-0 exists before it
starts, so that the job is over before it can queue. Every forward takes PACE_S. A checkpoint is saved
every 2 steps (2 epochs of 8 steps); a rank that finishes writes OUT_DIR/done-<member>.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset

OUT = sys.argv[1]
EVENTS = [tuple(e.split(":")) for e in sys.argv[2:] if ":" in e]
LATE = "late" in sys.argv[2:]
LOOP = "loop" in sys.argv[2:]
PACE_S = 0.02
UID = int(os.environ.get("LOCKSTEP_MEMBER_ID", os.environ.get("RANK", "0")))
steps = [0]


def maybe_act() -> None:
    for what, member, at in EVENTS:
        if int(member) != UID or steps[0] < int(at):
            continue
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        marker = os.path.join(OUT, f"raised-{UID}")
        if what in ("raise", "raise_runtime") and not os.path.exists(marker):
            with open(marker, "w") as fh:
                fh.write(repr(time.time()))
            kind = ValueError if what == "raise" else RuntimeError
            raise kind(f"boom on launch rank {UID} at step {steps[0]}")


class Numbers(Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, (x.sum() > 0).long()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maybe_act()
        time.sleep(PACE_S)
        return self.body(x)


class CountingSGD(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        steps[0] += 1
        return super().step(closure)


def train_in_own_loop() -> None:
    import lockstep
    from lockstep.data import MicroBatchSampler

    torch.manual_seed(0)
    net, data = Net(), Numbers()
    optimizer = CountingSGD(net.parameters(), lr=0.1)
    sampler = MicroBatchSampler(range(len(data)), micro_batch_size=4, num_micro_batches=3)
    loop = lockstep.LiveLoop(net, optimizer, sampler)

    def micro_step(indices: list[int]) -> float:
        inputs, targets = zip(*(data[i] for i in indices))
        loss = nn.functional.cross_entropy(net(torch.stack(inputs)), torch.stack(targets))
        loss.backward()
        return float(loss.detach())

    for epoch in range(loop.epoch, 2):
        for _ in loop.train_epoch(epoch, micro_step):
            pass


def main() -> None:
    if LATE and os.environ.get("LOCKSTEP_LIVE_JOIN") == "1":
        while not os.path.exists(os.path.join(OUT, "done-0")):
            time.sleep(0.05)
    import lockstep

    with open(os.path.join(OUT, f"pid-{UID}"), "w") as fh:
        fh.write(str(os.getpid()))
    if LOOP:
        lockstep.init()
        train_in_own_loop()
        with open(os.path.join(OUT, f"done-{UID}"), "w") as fh:
            fh.write(str(os.getpid()))
        lockstep.shutdown()
        return
    torch.manual_seed(0)
    config = lockstep.FitConfig(
        run_dir=os.path.join(OUT, "run"),
        epochs=2,
        global_batch_size=12,  # 3 micro-batches: every rank of 3 has a forward
        micro_batch_size=4,
        deterministic=True,
        checkpoint_every=2,
        log_every=4,
        progress="none",
    )
    lockstep.fit(
        Net(),
        Numbers(),
        loss_fn=nn.functional.cross_entropy,
        config=config,
        optimizer=lambda params: CountingSGD(params, lr=0.1),
    )
    with open(os.path.join(OUT, f"done-{UID}"), "w") as fh:
        fh.write(str(os.getpid()))
    lockstep.shutdown()


if __name__ == "__main__":
    main()
