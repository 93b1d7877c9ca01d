"""Sharded optimizer state (ZeRO-1) through `replicate`: the unsharded run's bits, 1/world of the state.

Each call trains two replicas of the same model on the same per-rank data, one stepping the optimizer
itself and one stepping `handle.shard_optimizer(optimizer)`, with SGD (momentum, weight decay), Adam and
AdamW under an LR schedule. The parameters and the consolidated optimizer state must equal the unsharded
run's bit for bit, on every rank; each rank must hold state for the parameters it owns only, and the
shares must add up to the unsharded state. The full state must load into an unsharded optimizer, and
back into a sharded one at another world size, with the same bits.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lockstep
from lockstep.data import MicroBatchSampler
from lockstep.engine import ShardedOptimizer
from lockstep.errors import NotSupportedError, UsageError
from lockstep.testing import run_distributed

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and in both runs
    # The middle weight (1 MiB) travels in place after a step, the others packed into one message per owner.
    return nn.Sequential(nn.Linear(12, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 3))


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def _train(
    name: str, sharded: bool, piece_numel: int | None = None
) -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    rank = dist.get_rank()
    model = _model()
    handle = lockstep.replicate(model)
    optimizer = _optimizer(name, model.parameters())
    stepped: Any = (
        ShardedOptimizer(optimizer, piece_numel=piece_numel) if sharded else optimizer
    )  # what handle.shard_optimizer(optimizer) makes, with the pieces' size chosen
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 12, generator=data), torch.randn(8, 3, generator=data)
        stepped.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        stepped.step()
        schedule.step()
    handle.remove()
    return model, stepped, optimizer


def _state_numel(state: Any) -> int:
    """Elements of the state's tensors shaped like their parameter (not the step counts)."""
    return sum(
        t.numel() for s in state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()
    )


def _flat(state: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for index, entry in sorted(state["state"].items()):
        for key, value in sorted(entry.items()):
            out.append((f"{index}.{key}", value.clone() if isinstance(value, torch.Tensor) else value))
    return out


def _sharded_against_plain(name: str, piece_numel: int | None) -> dict[str, Any]:
    plain_model, _, plain = _train(name, sharded=False)
    model, sharded, optimizer = _train(name, sharded=True, piece_numel=piece_numel)
    sharded.consolidate_state_dict(to=None)
    full = sharded.state_dict()
    params = list(model.parameters())
    return {
        "plain": [p.detach().clone() for p in plain_model.parameters()],
        "sharded": [p.detach().clone() for p in params],
        "plain_state": _flat(plain.state_dict()),
        "full_state": _flat(full),
        "groups_equal": full["param_groups"] == plain.state_dict()["param_groups"],
        "local_numel": _state_numel(sharded.state),
        "plain_numel": _state_numel(plain.state),
        "own_state_entries": len(optimizer.state),  # the optimizer's own: empty, the share is sharded.state
        "units_with_state": sorted(u for u, t in enumerate(sharded.units.tensors) if t in sharded.state),
        "units_owned": sorted(u for u, owner in enumerate(sharded.owners) if owner == dist.get_rank()),
        "owned": sorted(i for i, p in enumerate(params) if dist.get_rank() in sharded.owners_of(p)),
        "pieces": [len(sharded.owners_of(p)) for p in params],
    }


def _check(results: list[dict[str, Any]], name: str) -> None:
    world = len(results)
    for rank, out in enumerate(results):
        where = f"{name} rank {rank}/{world}"
        for i, (mine, theirs) in enumerate(zip(out["sharded"], out["plain"])):
            assert torch.equal(mine, theirs), f"{where}: parameter {i} differs from the unsharded run"
            assert torch.equal(mine, results[0]["sharded"][i]), f"{where}: parameter {i} differs from rank 0"
        assert [k for k, _ in out["full_state"]] == [k for k, _ in out["plain_state"]], where
        for (key, mine), (_, theirs) in zip(out["full_state"], out["plain_state"]):
            assert torch.equal(torch.as_tensor(mine), torch.as_tensor(theirs)), (
                f"{where}: state {key} differs"
            )
        assert out["groups_equal"], where
        assert out["units_with_state"] == out["units_owned"], f"{where}: state outside this rank's share"
        assert out["own_state_entries"] == 0, where
        assert 0 < out["local_numel"] < out["plain_numel"], where
    assert sum(out["local_numel"] for out in results) == results[0]["plain_numel"]
    owned = sorted({i for out in results for i in out["owned"]})
    assert owned == list(range(len(results[0]["plain"]))), "every parameter has an owner"


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_sharded_steps_give_the_unsharded_bits_with_a_share_of_the_state_on_2_ranks(name: str) -> None:
    _check(run_distributed(_sharded_against_plain, 2, args=(name, None), timeout=120), name)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_parameters_cut_into_pieces_give_the_unsharded_bits_and_an_even_share(name: str) -> None:
    """The 512x512 weight (97% of the model) in six pieces: whole, its owner would keep 97% of the state;
    in pieces, each rank keeps about half."""
    results = run_distributed(_sharded_against_plain, 2, args=(name, 50_000), timeout=120)
    _check(results, name)
    assert results[0]["pieces"] == [1, 1, 6, 1, 1, 1], results[0]["pieces"]
    shares = [out["local_numel"] / out["plain_numel"] for out in results]
    assert all(0.4 < share < 0.6 for share in shares), shares


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_sharded_steps_give_the_unsharded_bits_on_3_ranks(name: str) -> None:
    _check(run_distributed(_sharded_against_plain, 3, args=(name, 50_000), timeout=180), name)


def _full_state_moves_between_sharded_and_plain(saved: dict[str, Any] | None) -> dict[str, Any]:
    """First call (saved None): train sharded, return the full state. Second call, at another world size:
    load it into a sharded and a plain optimizer, take one more step each, compare."""
    if saved is None:
        _, sharded, _ = _train("adamw", sharded=True, piece_numel=50_000)
        sharded.consolidate_state_dict(to=0)
        state = sharded.state_dict() if dist.get_rank() == 0 else None
        return {"state": state, "params": _model().state_dict()}
    out: dict[str, Any] = {}
    for kind in ("plain", "sharded"):
        model = _model()
        handle = lockstep.replicate(model)
        optimizer = _optimizer("adamw", model.parameters())
        stepped: Any = (
            handle.shard_optimizer(optimizer, piece_numel=70_000) if kind == "sharded" else optimizer
        )
        stepped.load_state_dict(copy.deepcopy(saved))  # the optimizer takes the tensors it is given
        x = torch.ones(4, 12)
        nn.functional.mse_loss(model(x), torch.zeros(4, 3)).backward()
        stepped.step()
        if kind == "sharded":
            stepped.consolidate_state_dict(to=None)
            out["local_entries"] = len(stepped.state)
        out[kind] = (_flat(stepped.state_dict()), [p.detach().clone() for p in model.parameters()])
        handle.remove()
    return out


def test_the_full_state_loads_into_a_plain_optimizer_and_into_another_world_size() -> None:
    saved = run_distributed(_full_state_moves_between_sharded_and_plain, 2, args=(None,), timeout=120)
    state = saved[0]["state"]
    assert len(state["state"]) == 6, "the consolidated state holds every parameter's entry"
    for world in (1, 3):
        results = run_distributed(
            _full_state_moves_between_sharded_and_plain, world, args=(state,), timeout=180
        )
        for rank, out in enumerate(results):
            plain_state, plain_params = out["plain"]
            sharded_state, sharded_params = out["sharded"]
            assert [k for k, _ in plain_state] == [k for k, _ in sharded_state]
            for (key, a), (_, b) in zip(plain_state, sharded_state):
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (
                    f"world {world} rank {rank}: {key}"
                )
            for a, b in zip(plain_params, sharded_params):
                assert torch.equal(a, b), f"world {world} rank {rank}"
            assert out["local_entries"] < 6 or world == 1


def _misuse() -> list[str]:
    model = _model()
    handle = lockstep.replicate(model)
    sharded = handle.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    errors = []
    try:
        sharded.state_dict()
    except UsageError as exc:
        errors.append(str(exc))
    try:
        sharded.step(lambda: 0.0)
    except NotSupportedError as exc:
        errors.append(str(exc))
    handle.remove()
    sampler = MicroBatchSampler(list(range(32)), 4, 4)
    try:
        lockstep.LiveLoop(model, sharded, sampler)  # type: ignore[arg-type]
    except NotSupportedError as exc:
        errors.append(str(exc))
    return errors


def test_state_dict_before_consolidating_a_closure_and_live_loop_raise() -> None:
    for rank, errors in enumerate(run_distributed(_misuse, 2, timeout=60)):
        assert len(errors) == 3, errors
        assert errors[0].startswith(f"[rank {rank}/2] ") and "consolidate_state_dict" in errors[0]
        assert "closure" in errors[1]
        assert "LiveLoop does not re-cut a ShardedOptimizer's shares" in errors[2]


def test_sharded_optimizer_is_public() -> None:
    assert lockstep.engine.ShardedOptimizer is ShardedOptimizer


def _a_lost_share_is_rebuilt_from_its_copy(lost: list[int]) -> dict[str, Any]:
    """Live mode's sharding (two copies of each share, the all-gather deferred) on the ranks of the world;
    after the steps, the ranks in `lost` drop out (as if killed after the last step counted, before its
    all-gather) and the others replicate the model again and regroup over a new group without them, as
    fit's live recovery does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = dist.new_group(list(range(world)))
    survivors = [r for r in range(world) if r not in lost]
    model = _model()
    handle = lockstep.replicate(model, process_group=everyone)
    optimizer = _optimizer("adamw", model.parameters())
    sharded = ShardedOptimizer(
        optimizer, process_group=everyone, copies=2, defer_gather=True, piece_numel=50_000
    )
    plain_model = _model()
    plain_handle = lockstep.replicate(plain_model, process_group=everyone)
    plain = _optimizer("adamw", plain_model.parameters())
    data = torch.Generator().manual_seed(7 + rank)
    for step in range(STEPS):
        x, y = torch.randn(8, 12, generator=data), torch.randn(8, 3, generator=data)
        for m, o in ((model, sharded), (plain_model, plain)):
            o.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        if step < STEPS - 1:
            sharded.gather()
    kept_entries, units = len(sharded.state), len(sharded.units.tensors)
    handle.remove()
    plain_handle.remove()
    rest = dist.new_group(survivors)  # every rank takes part in making it
    out: dict[str, Any] = {"kept_entries": kept_entries, "units": units}
    if rank in lost:
        return out
    sharded.set_aside()  # as fit's live recovery does before the group changes...
    rebuilt = lockstep.replicate(model, process_group=rest)  # ...which then broadcasts rank 0's values
    sharded.group = rest
    try:
        sharded.regroup()
    except lockstep.errors.StateLostError as exc:
        out["error"] = str(exc)
        return out
    sharded.consolidate_state_dict(to=None)
    out["params_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    full, expected = _flat(sharded.state_dict()), _flat(plain.state_dict())
    out["state_equal"] = [k for k, _ in full] == [k for k, _ in expected] and all(
        torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for (_, a), (_, b) in zip(full, expected)
    )
    out["entries_after"] = len(sharded.state)
    rebuilt.remove()
    return out


def test_live_mode_rebuilds_a_lost_share_from_its_copy_and_refuses_when_both_copies_are_lost() -> None:
    results = run_distributed(_a_lost_share_is_rebuilt_from_its_copy, 3, args=([1],), timeout=180)
    assert all(0 < out["kept_entries"] < out["units"] for out in results), results  # two of three shares
    for rank in (0, 2):
        assert results[rank]["params_equal"] and results[rank]["state_equal"], results[rank]
        assert results[rank]["entries_after"] == results[rank]["units"]  # two survivors, two copies each
    # ranks 1 and 2 of 4 hold the only two copies of share 2 (rank 1 keeps shares 1 and 2, rank 2 keeps 2, 3)
    results = run_distributed(_a_lost_share_is_rebuilt_from_its_copy, 4, args=([1, 2],), timeout=180)
    for rank in (0, 3):
        assert "were all lost together" in results[rank]["error"], results[rank]
        assert results[rank]["error"].startswith(f"[rank {rank // 3}/2] "), results[rank]


def _checkpoint_round_trip(run_dir: str, kind: str, phase: str) -> list[tuple[str, Any]]:
    """phase "save": train 3 steps (sharded by lockstep or by torch's ZeroRedundancyOptimizer) and save with
    CheckpointManager; phase "load": load that checkpoint into a plain AdamW; its full state, flattened."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lockstep.checkpoint import CheckpointManager

    model = _model()
    manager = CheckpointManager(run_dir)
    if phase == "load":
        plain = _optimizer("adamw", model.parameters())
        manager.load({"model": model, "optimizer": plain}, required=True)
        return _flat(plain.state_dict())
    handle = lockstep.replicate(model)
    if kind == "torch":
        stepped: Any = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    else:
        stepped = handle.shard_optimizer(_optimizer("adamw", model.parameters()), piece_numel=50_000)
    data = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        stepped.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(torch.randn(4, 12, generator=data)), torch.zeros(4, 3)).backward()
        stepped.step()
    manager.save(3, {"model": model, "optimizer": stepped})
    stepped.consolidate_state_dict(to=0)  # what rank 0 saved, to compare with what loads
    handle.remove()
    return _flat(stepped.state_dict()) if dist.get_rank() == 0 else []


@pytest.mark.parametrize("kind", ["lockstep", "torch"])
def test_checkpoint_manager_saves_the_full_state_of_a_sharded_optimizer(tmp_path: Path, kind: str) -> None:
    saved = run_distributed(_checkpoint_round_trip, 2, args=(str(tmp_path), kind, "save"), timeout=120)[0]
    loaded = run_distributed(_checkpoint_round_trip, 1, args=(str(tmp_path), kind, "load"), timeout=120)[0]
    assert len({key.split(".")[0] for key, _ in saved}) == 6  # every parameter's state
    assert [k for k, _ in loaded] == [k for k, _ in saved]
    for (key, a), (_, b) in zip(loaded, saved):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), key
