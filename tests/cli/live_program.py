"""A deterministic lockstep.fit run that loses a rank on purpose, for tests/cli/test_live.py.

argv: OUT_DIR FAULT VICTIM AT. FAULT says where launch rank VICTIM dies (SIGKILL) on its AT-th call:
"forward" (in a forward), "backward" (in a gradient hook: its peers are inside the step's all-reduces),
"optimizer" (in optimizer.step, after the gradients were averaged), "commit" (after its all-reduces of
the step completed, before it counted itself done: the others must all redo the step, none may count
it), three faults at start-up: "startup" (before lockstep.init: the others form the first group without
it), "forming" (as the first group forms: the others give up on it after the formation timeout and form
the next without it), "replicate" (in the model's start-up collectives inside fit), "checkpoint" (in the state_dict()
call of a checkpoint save: rank 0 writes while the others wait), "stop" (SIGSTOP in a forward: it
stops answering without dying), "heal" (VICTIM dies in a forward as for "forward"; then, once the world
is back to 4, launch rank 0 dies in the state_dict() call that gathers the state for the replacement: the
peer it heals from is lost while it heals), "twice" (VICTIM dies in a forward as for "forward"; then launch
rank 1 dies as the survivors rebuild their replica over the new group: a second fault inside the
recovery from the first), "stopreform" (VICTIM dies in a forward as for "forward"; then launch rank 1 is
SIGSTOPped as it is about to check in to the survivors' next generation: a member stopped while the
group re-forms, when no hang watchdog runs), "write" (with "async": VICTIM's background checkpoint thread
writes half of the first file of the checkpoint of step AT, then SIGKILLs the process while training goes on), or "none". Every rank appends the sample ids that reached its forward to
OUT_DIR/seen-<launch rank>.txt; the summary is in OUT_DIR/run. A replacement (`--max-restarts`) has
launch rank N, N+1, ... (LOCKSTEP_MEMBER_ID); RANK is the rank it replaces. With a fifth argument
"replace", the survivors of a smaller world wait in their forwards until the replacement has queued to
join (it writes OUT_DIR/queued-<launch rank> as it does), so that it joins at the next boundary however
slowly this machine starts a process and imports torch; with "slow", each forward
takes 0.1 s longer, so that a test can act (take a link down) while the job runs; with "float", the run is
not in deterministic mode (live mode's float step); with "shard", the optimizer's state is sharded over
the ranks (shard_optimizer=True, each share kept by two ranks in live mode); with "diloco" or "local_sgd",
low-communication training (FitConfig.sync) with a round of 4 steps ("h2": 2), "streaming_diloco" with 2
fragments (synced after steps 2 and 4 of each round of 4); with "stop6", the run
stops after 6 steps (max_steps, in the middle of a round) and a second launch resumes it; with "long", the run
has 8 epochs (64 steps) instead of 2; with "paced", each forward takes 20 ms longer, and FAULT "straggle"
makes launch rank VICTIM's forwards take 40 ms longer instead, from its AT-th forward on (a rank persistently
about 2x slower than the others, for `--evict-stragglers`). Every rank that finishes
saves its final parameters to OUT_DIR/params-<launch rank>.pt and its summary's digests (params_sha256,
outer_sha256, ...) to OUT_DIR/summary-<launch rank>.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import lockstep

OUT, FAULT, VICTIM, AT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
REPLACE = "replace" in sys.argv[5:]
SLOW = "slow" in sys.argv[5:]  # 0.1 s per forward: a test has time to act while the job runs
FLOAT = "float" in sys.argv[5:]  # live mode without deterministic mode
SHARD = "shard" in sys.argv[5:]  # sharded optimizer state (ZeRO-1)
SYNC = next((a for a in sys.argv[5:] if a in ("diloco", "local_sgd", "streaming_diloco")), "allreduce")
FRAGMENTS = 2 if SYNC == "streaming_diloco" else 1
SYNC_EVERY = 2 if "h2" in sys.argv[5:] else 4
MAX_STEPS = 6 if "stop6" in sys.argv[5:] else None
EPOCHS = 8 if "long" in sys.argv[5:] else 2
ASYNC = "async" in sys.argv[5:]  # checkpoints written in the background, every one of them kept
PACE_S = 0.020 if "paced" in sys.argv[5:] else 0.0  # a step is not all noise on a loaded machine
SYNC_DTYPE = "int4" if "int4" in sys.argv[5:] else "fp32"  # the outer gradients quantized on the wire
FRAGMENT_DELAY = 3 if "tau3" in sys.argv[5:] else 1  # streaming: a fragment's mean in flight 3 steps
# The launch rank (RANK outside live mode): it does not change when the group is re-formed.
UID = int(os.environ.get("LOCKSTEP_MEMBER_ID", os.environ["RANK"]))
calls = {"forward": 0, "backward": 0, "optimizer": 0, "checkpoint": 0, "commit": 0, "replicate": 0}
forwards = [0]


def pace() -> None:
    forwards[0] += 1
    straggling = FAULT == "straggle" and UID == VICTIM and forwards[0] >= AT
    time.sleep(2 * PACE_S if straggling else PACE_S)


def maybe_die(where: str) -> None:
    if FAULT == "heal" and where == "checkpoint" and UID == 0 and torch.distributed.get_world_size() == 4:
        if os.path.exists(os.path.join(OUT, "pid-4")):  # the world grew back: this call gathers its state
            os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "twice" and where == "replicate" and UID == 1 and torch.distributed.get_world_size() == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # the survivors rebuild their replica after VICTIM's death
    fault = "forward" if FAULT in ("stop", "heal", "twice", "stopreform") else FAULT
    if UID != VICTIM or fault != where:
        return
    calls[where] += 1
    if calls[where] == AT:
        os.kill(os.getpid(), signal.SIGSTOP if FAULT == "stop" else signal.SIGKILL)


class Numbers(Dataset):
    def __len__(self) -> int:
        return 192

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return torch.cat([x, torch.tensor([float(i)])]), (x.sum() > 0).long()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
        self.body[0].weight.register_hook(self._in_backward)
        self.seen = open(os.path.join(OUT, f"seen-{UID}.txt"), "a")  # noqa: SIM115

    def _in_backward(self, grad: torch.Tensor) -> torch.Tensor:
        maybe_die("backward")
        return grad

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        maybe_die("checkpoint")
        return super().state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        maybe_die("replicate")  # the first call is replicate's, before its collectives
        return super().named_parameters(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maybe_die("forward")
        if REPLACE and torch.distributed.get_world_size() < 4:  # a rank was lost: wait for its replacement
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(OUT, "queued-4")) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)  # its queue entry is written just after the file
        if SLOW:
            time.sleep(0.1)
        pace()
        self.seen.write(" ".join(str(int(i)) for i in x[:, -1]) + "\n")
        self.seen.flush()
        return self.body(x[:, :-1])


class DyingSGD(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        maybe_die("optimizer")
        return super().step(closure)


def _die_before_commit() -> None:
    from lockstep.runtime.membership.group import LiveGroup

    commit = LiveGroup.commit

    def dying_commit(self: LiveGroup, step: int, rows: bytes | None = None, *, work: str = "") -> None:
        if not work:  # a step's commit (not the work between steps, which commits too)
            maybe_die("commit")
        commit(self, step, rows, work=work)

    LiveGroup.commit = dying_commit  # type: ignore[method-assign]


def _die_while_writing() -> None:
    from lockstep.checkpoint import storage

    write_all = storage._write_all

    def dying_write(fd: int, data: bytes) -> None:
        if f"step_{AT:06d}" in os.readlink(
            f"/proc/self/fd/{fd}"
        ):  # checkpoint AT's first file: half, then gone
            os.write(fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        write_all(fd, data)

    storage._write_all = dying_write


def _die_while_forming() -> None:
    from lockstep.runtime.membership.formation import Formation

    def dying_form(self: Formation) -> None:
        os.kill(os.getpid(), signal.SIGKILL)  # checked in, then gone before its group formed

    Formation.form_group = dying_form  # type: ignore[method-assign]


def _stop_while_reforming() -> None:
    from lockstep.runtime.membership.formation import Formation

    next_generation = Formation.next_generation

    def stopping(self: Formation, first, cause, joiners, checkin_s=None):  # type: ignore[no-untyped-def]
        if checkin_s is None and not joiners:  # a re-formation after a loss (not the start-up's)
            os.kill(os.getpid(), signal.SIGSTOP)
        return next_generation(self, first, cause, joiners, checkin_s)

    Formation.next_generation = stopping  # type: ignore[method-assign]


def _say_when_queued() -> None:
    """A replacement writes OUT_DIR/queued-<launch rank> as it queues to join: the survivors of "replace"
    wait for it, not for a time that a loaded machine may exceed."""
    from lockstep.runtime.membership.admission import Admission

    wait = Admission.wait_for_admission

    def queue_and_wait(self: Admission):  # type: ignore[no-untyped-def]
        with open(os.path.join(OUT, f"queued-{UID}"), "w") as fh:
            fh.write(str(os.getpid()))
        return wait(self)

    Admission.wait_for_admission = queue_and_wait  # type: ignore[method-assign]


def main() -> None:
    if REPLACE:
        _say_when_queued()
    if FAULT == "commit":
        _die_before_commit()
    if FAULT == "write" and UID == VICTIM:
        _die_while_writing()
    if UID == VICTIM and FAULT == "startup":
        os.kill(os.getpid(), signal.SIGKILL)
    if UID == VICTIM and FAULT == "forming":
        _die_while_forming()
    if UID == 1 and FAULT == "stopreform":
        _stop_while_reforming()
    with open(os.path.join(OUT, f"pid-{UID}"), "w") as fh:
        fh.write(str(os.getpid()))
    torch.manual_seed(0)
    config = lockstep.FitConfig(
        run_dir=os.path.join(OUT, "run"),
        epochs=EPOCHS,
        global_batch_size=24,
        micro_batch_size=4,
        deterministic=not FLOAT,
        shard_optimizer=SHARD,
        sync=SYNC,
        sync_every=SYNC_EVERY,
        fragments=FRAGMENTS,
        sync_dtype=SYNC_DTYPE,
        fragment_delay=FRAGMENT_DELAY,
        max_steps=MAX_STEPS,
        checkpoint_async=ASYNC,
        keep_checkpoints=8 if ASYNC else 3,
        log_every=4,
        progress="none",
    )
    net = Net()
    result = lockstep.fit(
        net,
        Numbers(),
        loss_fn=nn.functional.cross_entropy,
        config=config,
        optimizer=lambda params: DyingSGD(params, lr=0.1, momentum=0.9),
    )
    torch.save(net.body.state_dict(), os.path.join(OUT, f"params-{UID}.pt"))  # body: no fault hook
    with open(os.path.join(OUT, f"summary-{UID}.json"), "w") as fh:
        json.dump({k: v for k, v in result.summary.items() if k.endswith("sha256")}, fh)
    with open(os.path.join(OUT, f"done-{UID}"), "w") as fh:
        fh.write(str(os.getpid()))  # the same process that started: it was never restarted
    lockstep.shutdown()


if __name__ == "__main__":
    main()
