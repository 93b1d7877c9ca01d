"""Sharded checkpoints (FSDP2 and HSDP: `fully_shard` on a DeviceMesh, DTensor parameters) on real gloo ranks:
every rank writes its own shards through torch.distributed.checkpoint into the checkpoint's `sharded/`; the
checkpoint loads bitwise into another mesh (FSDP 4 -> FSDP 2, HSDP 2x2) and into a plain replicated model and
optimizer, and one more step continues identically; a replicated checkpoint loads into an FSDP run; a rank
failing mid-write, a damaged shard and a background save behave as a replicated checkpoint's do; another
model's checkpoint is refused with one line naming the mismatch."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lockstep.checkpoint import CheckpointManager, compare_checkpoints
from lockstep.checkpoint import sharded as sharded_module
from lockstep.checkpoint.compare import load_checkpoint
from lockstep.errors import CheckpointError
from lockstep.runtime import get_rank, get_world_size
from lockstep.testing import run_distributed

TIMEOUT = 150


def _model(seed: int, hidden: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 4)
    )


def _mesh(shape: tuple[int, ...]) -> Any:
    if len(shape) == 2:
        return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", shape)


def _sharded(seed: int, shape: tuple[int, ...], hidden: int = 16) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(seed, hidden)
    mesh = _mesh(shape)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _plain(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach().clone() if isinstance(t, DTensor) else t.detach().clone()


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The parameters and the optimizer state, whole (a collective for DTensors), by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {n: _whole(p) for n, p in model.named_parameters()},
        "optim": {
            names[id(p)]: {k: _whole(v) for k, v in optimizer.state[p].items()}
            for g in optimizer.param_groups
            for p in g["params"]
        },
    }


def _assert_bitwise(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert a["params"].keys() == b["params"].keys(), where
    for name, tensor in a["params"].items():
        assert torch.equal(tensor, b["params"][name]), f"{where}: parameter {name} differs"
    assert a["optim"].keys() == b["optim"].keys(), where
    for name, state in a["optim"].items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, state.keys()
        for key, tensor in state.items():
            assert torch.equal(tensor, b["optim"][name][key]), f"{where}: optimizer {name}.{key} differs"


# The third step's batch is the same on every rank: the mean gradient is then the same at any layout, and the
# step continues identically (every division by the world size is by a power of two, exact).
SAME_BATCH = 1000


def _save_fsdp(run_dir: str) -> dict[str, Any]:
    model, optimizer = _sharded(seed=1, shape=(get_world_size(),))
    for step in (1, 2):
        _step(model, optimizer, seed=step * 10 + get_rank())  # each rank its own batch
    manager = CheckpointManager(run_dir)
    manager.save(2, {"model": model, "optimizer": optimizer, "progress": {"step": 2}})
    saved = _full(model, optimizer)
    _step(model, optimizer, seed=SAME_BATCH)
    return {"saved": saved, "after": _full(model, optimizer)}


def _load(run_dir: str, layout: str) -> dict[str, Any]:
    if layout == "plain":
        model, optimizer = _plain(seed=7)
    else:
        model, optimizer = _sharded(seed=7, shape=(2, 2) if layout == "hsdp" else (get_world_size(),))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "progress": None}
    out: dict[str, Any] = {"step": CheckpointManager(run_dir).load(state), "progress": state["progress"]}
    out["loaded"] = _full(model, optimizer)
    _step(model, optimizer, seed=SAME_BATCH)
    out["after"] = _full(model, optimizer)
    if layout == "fsdp":  # another model (wider layers) is refused on every rank, naming the mismatch
        other, other_optimizer = _sharded(seed=7, shape=(get_world_size(),), hidden=24)
        try:
            CheckpointManager(run_dir).load({"model": other, "optimizer": other_optimizer})
        except CheckpointError as exc:
            out["other"] = str(exc)
    return out


def test_a_sharded_checkpoint_loads_at_any_layout_bitwise(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    saved = run_distributed(_save_fsdp, 4, args=(run_dir,), timeout=TIMEOUT)[0]
    step_dir = tmp_path / "run/checkpoints/step_000002"
    shards = sorted(p.name for p in (step_dir / "sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"], shards
    sizes = [(step_dir / "sharded" / f"__{r}_0.distcp").stat().st_size for r in range(4)]
    assert max(sizes) < 0.5 * sum(sizes), f"each rank wrote its own shards, not the whole state: {sizes}"
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["sharded"] == "sharded" and meta["format_version"] == 2
    assert {f"sharded/{n}" for n in shards} <= set(meta["files"]), meta["files"].keys()
    assert meta["entries"]["model"]["kind"] == meta["entries"]["optimizer"]["kind"] == "sharded"
    assert meta["entries"]["optimizer"]["model"] == "model" and meta["entries"]["progress"]["kind"] == "value"
    assert not (step_dir / "model.safetensors").exists(), "rank 0 wrote no gathered copy of the model"
    whole = load_checkpoint(step_dir)  # `lockstep compare` reads the sharded part whole, in one process
    for name, tensor in saved["saved"]["params"].items():
        assert torch.equal(whole["model"][name], tensor), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(whole["optimizer"]["state"][name][key], saved["saved"]["optim"][name][key])
    assert whole["progress"] == {"step": 2} and compare_checkpoints(step_dir, step_dir).equal

    for layout, world in (("fsdp", 2), ("hsdp", 4), ("plain", 2)):
        outs = run_distributed(_load, world, args=(run_dir, layout), timeout=TIMEOUT)
        for rank, out in enumerate(outs):
            where = f"{layout} at {world} ranks, rank {rank}"
            assert out["step"] == 2 and out["progress"] == {"step": 2}, where
            _assert_bitwise(saved["saved"], out["loaded"], f"{where}, loaded")
            _assert_bitwise(saved["after"], out["after"], f"{where}, one step later")
            if layout == "fsdp":
                assert "\n" not in out["other"] and "does not fit state['model']" in out["other"], out[
                    "other"
                ]
                assert "shape mismatches: 0.weight checkpoint [16, 8] vs model [24, 8]" in out["other"]


def _replicated_into_fsdp(run_dir: str) -> dict[str, Any]:
    model, optimizer = _plain(seed=1)
    for step in (1, 2):
        _step(model, optimizer, seed=step)  # the same batches on every rank: the replicas agree
    CheckpointManager(run_dir).save(2, {"model": model, "optimizer": optimizer})
    sharded, sharded_optimizer = _sharded(seed=5, shape=(get_world_size(),))
    loaded = CheckpointManager(run_dir).load({"model": sharded, "optimizer": sharded_optimizer})
    return {"step": loaded, "saved": _full(model, optimizer), "loaded": _full(sharded, sharded_optimizer)}


def test_a_replicated_checkpoint_loads_into_an_fsdp_run_bitwise(tmp_path: Path) -> None:
    for rank, out in enumerate(
        run_distributed(_replicated_into_fsdp, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    ):
        assert out["step"] == 2
        _assert_bitwise(out["saved"], out["loaded"], f"rank {rank}")
    step_dir = tmp_path / "checkpoints/step_000002"
    assert (step_dir / "model.safetensors").is_file() and not (step_dir / "sharded").exists()


def _failures(run_dir: str) -> dict[str, Any]:
    model, optimizer = _sharded(seed=1, shape=(get_world_size(),))
    _step(model, optimizer, seed=1)
    manager = CheckpointManager(run_dir)
    manager.save(1, {"model": model, "optimizer": optimizer})
    good = _full(model, optimizer)
    _step(model, optimizer, seed=2)
    real = dcp.FileSystemWriter.write_data
    out: dict[str, Any] = {}
    if get_rank() == 1:  # rank 1's disk fills up in the middle of its shards

        def full(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        dcp.FileSystemWriter.write_data = full  # type: ignore[method-assign]
    try:
        manager.save(2, {"model": model, "optimizer": optimizer})
    except CheckpointError as exc:
        out["blocking"] = str(exc)
    manager.save(3, {"model": model, "optimizer": optimizer}, blocking=False)  # fails on its thread
    try:
        manager.wait()
    except CheckpointError as exc:
        out["background"] = str(exc)
    dcp.FileSystemWriter.write_data = real  # type: ignore[method-assign]
    out["steps"] = manager.steps()
    out["leftovers"] = sorted(
        p.name for p in Path(run_dir, "checkpoints").iterdir() if p.name.startswith(".")
    )
    fresh, fresh_optimizer = _sharded(seed=9, shape=(get_world_size(),))
    out["loaded_step"] = CheckpointManager(run_dir).load({"model": fresh, "optimizer": fresh_optimizer})
    _assert_bitwise(good, _full(fresh, fresh_optimizer), f"rank {get_rank()}: the previous checkpoint")
    return out


def test_a_rank_failing_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    outs = run_distributed(_failures, 2, args=(str(run_dir),), timeout=TIMEOUT)
    for rank, out in enumerate(outs):
        assert out["blocking"] == (
            f"[rank {rank}/2] checkpoint step_000002 was not saved: writing its sharded part failed: "
            "rank 1: OSError: [Errno 28] No space left on device"
        ), out["blocking"]
        assert out["background"] == (
            f"[rank {rank}/2] checkpoint step_000003 was not saved (written in the background): writing its "
            "sharded part failed: rank 1: OSError: [Errno 28] No space left on device"
        ), out["background"]
        assert out["steps"] == [1] and out["loaded_step"] == 1 and out["leftovers"] == [], out

    # A checkpoint whose shard is damaged (here: a newer copy of step 1 with one shard truncated) is skipped.
    root = run_dir / "checkpoints"
    shutil.copytree(root / "step_000001", root / "step_000004")
    meta = json.loads((root / "step_000004/meta.json").read_text())
    meta["step"] = 4
    (root / "step_000004/meta.json").write_text(json.dumps(meta))
    shard = root / "step_000004/sharded/__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    outs = run_distributed(_load_newest, 2, args=(str(run_dir),), timeout=TIMEOUT)
    assert outs == [1, 1]


def _load_newest(run_dir: str) -> int | None:
    model, optimizer = _sharded(seed=9, shape=(get_world_size(),))
    return CheckpointManager(run_dir).load({"model": model, "optimizer": optimizer})


def _hold_shard_writes(trained: list[int], changed: threading.Condition) -> None:
    """Every rank's writer thread writes the shards of step S only once step S + 1 has trained: the files are
    then made from the CPU copy while the objects already hold later values."""
    real = sharded_module.write

    def held(state: Any, directory: Path, *args: Any) -> Any:
        step = int(threading.current_thread().name.rsplit("-", 1)[1])
        with changed:
            if not changed.wait_for(lambda: trained[0] > step, timeout=60):
                raise OSError(errno.ETIMEDOUT, "the test never trained past the saved step")
        return real(state, directory, *args)

    sharded_module.write = held  # type: ignore[assignment]


def _background(run_dir: str) -> dict[str, Any]:
    model, optimizer = _sharded(seed=1, shape=(get_world_size(),))
    manager = CheckpointManager(run_dir, keep=2)
    saved = {}
    trained, changed = [0], threading.Condition()
    _hold_shard_writes(trained, changed)
    for step in range(1, 5):
        _step(model, optimizer, seed=step * 10 + get_rank())
        with changed:
            trained[0] = step
            changed.notify_all()
        if step in (1, 2, 3):  # keep=2: step 1's is pruned
            manager.save(
                step, {"model": model, "optimizer": optimizer, "progress": {"step": step}}, blocking=False
            )
            saved[step] = _full(model, optimizer)  # training goes on while the shards are written
    manager.wait()
    out: dict[str, Any] = {
        "written": manager.written,
        "copy": manager.cpu_copy_bytes,
        "steps": manager.steps(),
    }
    fresh, fresh_optimizer = _sharded(seed=9, shape=(get_world_size(),))
    state: dict[str, Any] = {"model": fresh, "optimizer": fresh_optimizer, "progress": None}
    out["loaded"] = CheckpointManager(run_dir).load(state)
    _assert_bitwise(saved[3], _full(fresh, fresh_optimizer), f"rank {get_rank()}: the background checkpoint")
    out["progress"] = state["progress"]
    return out


def test_a_background_sharded_save_publishes_every_ranks_part(tmp_path: Path) -> None:
    for out in run_distributed(_background, 2, args=(str(tmp_path),), timeout=TIMEOUT):
        assert out["written"] == 3 and out["steps"] == [2, 3] and out["loaded"] == 3, out
        assert out["copy"] > 0, "every rank keeps a CPU copy of its shards"
        assert out["progress"] == {"step": 3}
    shards = sorted(p.name for p in (tmp_path / "checkpoints/step_000003/sharded").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]


class _Payload:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo unpickled > /dev/null",))


def test_a_sharded_part_is_read_with_weights_only_promises(tmp_path: Path) -> None:
    """DCP's `.metadata` is unpickled with an allow-list: a file naming anything else is refused."""
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded/.metadata").write_bytes(pickle.dumps(_Payload()))
    try:
        sharded_module.saved_shapes(tmp_path)
    except CheckpointError as exc:
        assert "refers to posix.system, which a checkpoint may not hold" in str(exc), exc
    else:
        raise AssertionError("a .metadata naming os.system was read")
