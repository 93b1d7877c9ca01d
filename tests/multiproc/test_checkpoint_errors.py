"""Bad input and crashes: damaged checkpoints fall back, other models are named, full or read-only disks
and killed writers never damage the last good checkpoint, and a failure on one rank raises on all.

Most tests run in a world of one (this process); one runs on 2 gloo ranks; two kill a real writer process.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lockstep.checkpoint import CheckpointManager, storage
from lockstep.errors import CheckpointError
from lockstep.runtime import get_rank
from lockstep.testing import run_distributed


def _model(seed: int = 0, hidden: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def _save_three(run_dir: Path) -> tuple[CheckpointManager, list[dict[str, torch.Tensor]]]:
    manager = CheckpointManager(run_dir, keep=3)
    saved = []
    for step in (1, 2, 3):
        model = _model(seed=step)
        manager.save(step, {"model": model, "note": f"step {step}"})
        saved.append({k: v.clone() for k, v in model.state_dict().items()})
    return manager, saved


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    logger = logging.getLogger("lockstep.checkpoint")
    handler = Keep()
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda d: _truncate(d / "model.safetensors"), "truncated"),
        (lambda d: _flip(d / "state.pt"), "sha256 of state.pt does not match"),
        (lambda d: (d / "rng.json").unlink(), "rng.json is missing"),
        (lambda d: (d / "meta.json").unlink(), "partial"),
        (lambda d: (d / "meta.json").write_text("{not json"), "partial"),
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(
    tmp_path: Path, warnings_seen: list[str], damage: Any, reason: str
) -> None:
    manager, saved = _save_three(tmp_path)
    damage(tmp_path / "checkpoints" / "step_000003")
    model, state = _model(seed=9), {"model": None, "note": ""}
    state["model"] = model
    assert manager.load(state) == 2
    assert state["note"] == "step 2"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[1].items())
    assert any("step_000003" in w and reason in w and "step_000002" in w for w in warnings_seen), (
        warnings_seen
    )


def test_nothing_usable_returns_none_or_raises_when_required(tmp_path: Path) -> None:
    missing = CheckpointManager(tmp_path / "nope")
    assert missing.load({"model": _model()}) is None
    with pytest.raises(CheckpointError, match="no checkpoint to resume from: .*nope does not exist"):
        missing.load({"model": _model()}, required=True)
    manager, _ = _save_three(tmp_path / "run")
    for step in (1, 2, 3):
        (tmp_path / "run" / "checkpoints" / f"step_{step:06d}" / "meta.json").unlink()
    with pytest.raises(
        CheckpointError, match="every checkpoint in .* is unusable: step_000003: meta.json missing"
    ):
        manager.load({"model": _model()}, required=True)


def test_an_entry_newer_than_the_checkpoint_loads_only_where_it_is_optional(tmp_path: Path) -> None:
    """A checkpoint saved before an entry existed (fit's `goodput`, say) still loads: that entry is left as
    it is when the load names it optional, and is an error otherwise."""
    manager, saved = _save_three(tmp_path / "run")

    class Account:
        def __init__(self) -> None:
            self.loaded: dict[str, Any] | None = None

        def state_dict(self) -> dict[str, Any]:
            return {"seconds": 1.0}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.loaded = state

    model, account = _model(), Account()
    with pytest.raises(CheckpointError, match=r"has no entry \['account'\]"):
        manager.load({"model": model, "account": account})
    assert manager.load({"model": model, "account": account}, optional=frozenset({"account"})) == 3
    assert all(torch.equal(v, saved[-1][k]) for k, v in model.state_dict().items())
    assert account.loaded is None  # not in the checkpoint: left as it was
    manager.save(4, {"model": model, "account": account})
    assert manager.load({"model": model, "account": account}, optional=frozenset({"account"})) == 4
    assert account.loaded == {"seconds": 1.0}  # in the checkpoint: loaded like any other entry


def test_a_checkpoint_of_another_model_lists_missing_unexpected_and_shapes(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(5, {"model": _model(hidden=8)})
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2), nn.Linear(2, 2))
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(CheckpointError) as info:
        manager.load({"model": other})
    message = str(info.value)
    assert "does not fit state['model'] (Sequential)" in message
    assert "2 missing (in the model, not in the checkpoint): 3.weight [2, 2], 3.bias [2]" in message
    assert (
        "0.weight checkpoint [8, 4] vs model [16, 4]" in message
        and "2.weight checkpoint [2, 8] vs model [2, 16]" in message
    )
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # nothing half-loaded
    extra = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(
        CheckpointError,
        match=r"2 unexpected \(in the checkpoint, not in the model\): 2.bias \[2\], 2.weight \[2, 8\]",
    ):
        manager.load({"model": extra})
    with pytest.raises(CheckpointError, match=r"has no entry \['optimizer'\]"):
        manager.load({"model": _model(), "optimizer": torch.optim.SGD(_model().parameters(), lr=0.1)})


class _Wrapper(nn.Module):
    """A DDP-like wrapper: the model is `.module`, so its state_dict keys start with `module.`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_wrapped_and_bare_models_share_checkpoints(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"model": _Wrapper(_model(seed=1))})
    bare, wrapped = _model(seed=2), _Wrapper(_model(seed=3))
    assert manager.load({"model": bare}) == 1
    assert manager.load({"model": wrapped}) == 1
    assert all(torch.equal(a, b) for a, b in zip(bare.parameters(), _model(seed=1).parameters()))
    assert all(torch.equal(a, b) for a, b in zip(wrapped.parameters(), bare.parameters()))


class _Opaque:
    def __init__(self) -> None:
        self.fn = print


def test_state_that_weights_only_cannot_load_is_refused_at_save_time(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"model": _model()})
    with pytest.raises(
        CheckpointError, match=r"state\['extra'\] holds objects that torch.load\(weights_only=True\) refuses"
    ):
        manager.save(2, {"model": _model(), "extra": {"obj": _Opaque()}})
    assert manager.steps() == [1]


def test_disk_full_mid_save_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, {"model": _model(seed=1)})
    real, calls = storage._write_all, []

    def fills_up(fd: int, data: bytes) -> None:
        calls.append(len(data))
        if len(calls) == 2:  # the second file of the checkpoint: half of it, then the disk is full
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(storage, "_write_all", fills_up)
    with pytest.raises(CheckpointError, match="no space left on the device.*untouched: step_000001"):
        manager.save(2, {"model": _model(seed=2)})
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001"]
    model = _model(seed=5)
    assert manager.load({"model": model}) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model(seed=1).parameters()))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 512 KiB tmpfs (root only): a disk that really fills up and can be remounted read-only."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_and_a_read_only_one_give_clear_errors(tiny_tmpfs: Path) -> None:
    manager = CheckpointManager(tiny_tmpfs / "run")
    manager.save(1, {"model": _model(seed=1)})
    with pytest.raises(
        CheckpointError, match="No space left on device.*no space left on the device.*untouched: step_000001"
    ):
        manager.save(2, {"model": nn.Linear(400, 400)})  # 640 KB of weights on a 512 KiB disk
    assert manager.steps() == [1] and not any(
        p.name.startswith(".") for p in (tiny_tmpfs / "run" / "checkpoints").iterdir()
    )
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    with pytest.raises(CheckpointError, match="the file system is read-only: use a writable run_dir"):
        manager.save(2, {"model": _model(seed=2)})
    with pytest.raises(CheckpointError, match="cannot create the checkpoint directory .*read-only"):
        CheckpointManager(tiny_tmpfs / "missing" / "run").save(1, {"model": _model()})
    model = _model(seed=7)
    assert manager.load({"model": model}) == 1


def test_run_dir_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot create the checkpoint directory .*file"):
        CheckpointManager(tmp_path / "file").save(1, {"model": _model()})


KILLER = textwrap.dedent("""
    import os, signal, sys, torch
    from torch import nn
    from lockstep.checkpoint import CheckpointManager, storage
    run_dir, where = sys.argv[1], sys.argv[2]
    manager = CheckpointManager(run_dir)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    manager.save(1, {"model": model})
    if where == "mid-write":  # SIGKILL after the first half of the second checkpoint's first file
        def dies(fd, data):
            os.write(fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        storage._write_all = dies
        manager.save(2, {"model": model})
    else:  # re-saving step 1: SIGKILL after moving the old step_000001 aside, before publishing the new one
        real_rename = storage.os.rename
        def dies(src, dst):
            real_rename(src, dst)
            os.kill(os.getpid(), signal.SIGKILL)
        storage.os.rename = dies
        manager.save(1, {"model": model})
""")


@pytest.mark.parametrize("where,survivor", [("mid-write", 1), ("mid-publish", 1)])
def test_a_writer_killed_mid_save_never_damages_the_previous_checkpoint(
    tmp_path: Path, where: str, survivor: int
) -> None:
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(script), str(run_dir), where],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers  # the killed save left its temp (or moved-aside) directory behind
    manager = CheckpointManager(run_dir)
    torch.manual_seed(0)
    expected = nn.Linear(64, 64)
    model = nn.Linear(64, 64)
    assert manager.load({"model": model}) == survivor
    assert torch.equal(model.weight, expected.weight)
    manager.save(2, {"model": model})  # the next save clears what the dead one left
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step_000001",
        "step_000002",
    ]


def _failures_on_two_ranks(run_dir: str) -> dict[str, Any]:
    manager = CheckpointManager(run_dir)
    manager.save(1, {"model": _model(seed=1)})
    out: dict[str, Any] = {}
    if get_rank() == 0:  # only the writer's disk fills up; rank 1 must not be left waiting

        def full(fd: int, data: bytes) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        storage._write_all = full
    try:
        manager.save(2, {"model": _model(seed=2)})
    except CheckpointError as exc:
        out["save"] = str(exc)
    model = _model(seed=3, hidden=8 if get_rank() == 0 else 5)  # rank 1 builds another model
    try:
        manager.load({"model": model})
    except CheckpointError as exc:
        out["load"] = str(exc)
    out["load_ok"] = manager.load({"model": _model(seed=4)})
    return out


def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    zero, one = run_distributed(_failures_on_two_ranks, 2, args=(str(tmp_path),), timeout=90)
    for rank, out in enumerate((zero, one)):
        assert out["save"].startswith(f"[rank {rank}/2] checkpoint step_000002 was not saved")
        assert "no space left on the device" in out["save"]
        assert out["load_ok"] == 1  # the last good checkpoint survived and loads everywhere
    assert "loading step_000001 failed on rank 1" in zero["load"]
    assert (
        "[rank 1/2] checkpoint" in one["load"] and "0.weight checkpoint [8, 4] vs model [5, 4]" in one["load"]
    )
