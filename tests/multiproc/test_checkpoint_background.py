"""CheckpointManager.save(..., blocking=False) on real gloo ranks: rank 0 copies the state to CPU memory at
the step boundary and writes it on a background thread while training changes the objects; the files hold
the bits a blocking save of the same step holds; a failure of the write is raised on every rank at the next
save or wait(); a load waits for the write in flight; a writer killed mid-write leaves the previous
checkpoint loadable."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

import lockstep
from lockstep.checkpoint import CheckpointManager, compare_checkpoints, storage
from lockstep.checkpoint import manager as manager_module
from lockstep.errors import CheckpointError
from lockstep.runtime import get_rank
from lockstep.testing import run_distributed


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _step(model: nn.Module, optimizer: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


class _TrainedSteps:
    """The steps the main thread has trained, for rank 0's background writes to wait on."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = threading.Condition()

    def trained(self, step: int) -> None:
        with self.changed:
            self.count = step
            self.changed.notify_all()

    def hold_background_writes(self) -> None:
        """A background save of step S encodes its files only once step S + 1 has trained: they are then
        made from the copy while the objects already hold later values (without a copy, they would differ)."""
        real = manager_module.encode

        def held(entries: Any) -> Any:
            thread = threading.current_thread()
            if thread is not threading.main_thread():  # the writer thread, named after its step
                step = int(thread.name.rsplit("-", 1)[1])
                with self.changed:
                    if not self.changed.wait_for(lambda: self.count > step, timeout=60):
                        raise OSError(errno.ETIMEDOUT, "the test never trained past the saved step")
            return real(entries)

        manager_module.encode = held


def _background_equals_blocking(run_dir: str, sharded: bool) -> dict[str, Any]:
    model = _model(seed=1)
    handle = lockstep.replicate(model)
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=0.01)
    if sharded:
        optimizer = handle.shard_optimizer(optimizer)
    background = CheckpointManager(Path(run_dir) / "background", keep=5)
    blocking = CheckpointManager(Path(run_dir) / "blocking", keep=5)
    progress = _TrainedSteps()
    if get_rank() == 0:
        progress.hold_background_writes()
    copies = []
    for step in range(1, 7):
        _step(model, optimizer, seed=step * 10 + get_rank())
        progress.trained(step)
        if step in (2, 4):
            state = {"model": model, "optimizer": optimizer, "step": step}
            background.save(step, state, blocking=False)  # returns before the files exist
            copies.append(background.cpu_copy_bytes)
            blocking.save(step, state)
    background.wait()
    return {
        "written": background.written,
        "stall_s": background.stall_s,
        "copies": copies,
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
    }


def _run_equal(tmp_path: Path, sharded: bool) -> None:
    outs = run_distributed(_background_equals_blocking, 2, args=(str(tmp_path), sharded), timeout=120)
    for step in (2, 4):
        name = f"step_{step:06d}"
        same = compare_checkpoints(
            tmp_path / "background/checkpoints" / name, tmp_path / "blocking/checkpoints" / name
        )
        assert same.equal, f"{name}: the background save differs from the blocking one: {same}"
    zero, one = outs
    assert zero["written"] == one["written"] == 2 and zero["stall_s"] > 0
    assert zero["copies"][0] > 0 and zero["copies"][0] == zero["copies"][1], "the CPU copy is kept and reused"
    assert one["copies"] == [0, 0], "a rank that does not write keeps no copy"


def test_a_background_save_writes_what_a_blocking_save_writes(tmp_path: Path) -> None:
    _run_equal(tmp_path, sharded=False)


def test_a_background_save_of_a_sharded_optimizer_holds_the_full_state(tmp_path: Path) -> None:
    _run_equal(tmp_path, sharded=True)


def _failure_surfaces_later(run_dir: str) -> dict[str, Any]:
    manager = CheckpointManager(run_dir)
    model = _model(seed=1)
    manager.save(1, {"model": model}, blocking=False)
    manager.wait()
    if get_rank() == 0:

        def full(fd: int, data: bytes) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        storage._write_all = full
    manager.save(2, {"model": _model(seed=2)}, blocking=False)  # returns: the failure is not known yet
    out: dict[str, Any] = {}
    try:
        manager.save(3, {"model": _model(seed=3)}, blocking=False)
    except CheckpointError as exc:
        out["next_save"] = str(exc)
    out["written"] = manager.written
    loaded = _model(seed=9)
    out["loaded"] = manager.load({"model": loaded})
    out["equal"] = all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))
    return out


def test_a_failed_background_write_is_raised_on_every_rank_at_the_next_save(tmp_path: Path) -> None:
    outs = run_distributed(_failure_surfaces_later, 2, args=(str(tmp_path),), timeout=90)
    for rank, out in enumerate(outs):
        assert out["next_save"].startswith(
            f"[rank {rank}/2] checkpoint step_000002 was not saved (written in the background): writing "
        ), out["next_save"]
        assert "step_000002" in out["next_save"] and "no space left on the device" in out["next_save"]
        assert out["written"] == 1 and out["loaded"] == 1 and out["equal"]


def _copy_failure_surfaces_later(run_dir: str) -> dict[str, Any]:
    manager = CheckpointManager(run_dir)
    manager.save(1, {"model": _model(seed=1)}, blocking=False)
    if get_rank() == 0:

        def no_memory(entries: Any) -> Any:
            raise MemoryError("no room for the CPU copy")

        manager.background.copy = no_memory  # type: ignore[method-assign]
    manager.save(2, {"model": _model(seed=2)}, blocking=False)  # returns: the failure is settled later
    out: dict[str, Any] = {}
    try:
        manager.wait()
    except CheckpointError as exc:
        out["wait"] = str(exc)
    out["written"] = manager.written
    out["steps"] = manager.steps()
    return out


def test_a_failed_copy_is_raised_on_every_rank_at_the_next_settle(tmp_path: Path) -> None:
    """A background save's copy failing on the writer is not agreed on at once (one collective fewer per
    save): the next save, wait() or load() raises it on every rank, as a failed write; nothing was written."""
    for rank, out in enumerate(
        run_distributed(_copy_failure_surfaces_later, 2, args=(str(tmp_path),), timeout=90)
    ):
        assert out["wait"] == (
            f"[rank {rank}/2] checkpoint step_000002 was not saved (written in the background): "
            "MemoryError: no room for the CPU copy"
        ), out
        assert out["written"] == 1 and out["steps"] == [1], out


def _load_waits(run_dir: str) -> dict[str, Any]:
    manager = CheckpointManager(run_dir)
    manager.save(5, {"model": _model(seed=1), "step": 5}, blocking=False)
    state: dict[str, Any] = {"model": _model(seed=2), "step": 0}
    return {"loaded": manager.load(state), "step": state["step"], "written": manager.written}


def test_a_load_waits_for_the_write_in_flight(tmp_path: Path) -> None:
    for out in run_distributed(_load_waits, 2, args=(str(tmp_path),), timeout=90):
        assert out == {"loaded": 5, "step": 5, "written": 1}


KILLER = textwrap.dedent("""
    import os, signal, sys, threading
    import torch
    from torch import nn
    from lockstep.checkpoint import CheckpointManager, storage
    manager = CheckpointManager(sys.argv[1])
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    manager.save(1, {"model": model}, blocking=False)
    manager.wait()
    def dies(fd, data):  # SIGKILL on the writer thread, half-way through the second checkpoint's first file
        os.write(fd, data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    storage._write_all = dies
    with torch.no_grad():
        model.weight.add_(1.0)
    manager.save(2, {"model": model}, blocking=False)
    threading.Event().wait(60)  # training goes on until the writer thread's SIGKILL
""")


def test_a_writer_killed_mid_background_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(script), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    torch.manual_seed(0)
    expected, model = nn.Linear(64, 64), nn.Linear(64, 64)
    assert CheckpointManager(run_dir).load({"model": model}) == 1
    assert torch.equal(model.weight, expected.weight) and torch.equal(model.bias, expected.bias)
