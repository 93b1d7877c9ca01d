"""A sharded model carried onto a new world (engine/sharded/rebuild.py): what live mode's surviving replica
group does after the other group is lost.

4 ranks as 2 groups of FSDP 2 train deterministically; after 3 steps group 1 leaves, group 0 destroys the
world, forms a new one of its 2 ranks, rebuilds its model from the meta skeleton with its local shards,
moves the optimizer (same object) onto it and trains 3 steps more. Deterministic mode gives the same bits at
any layout, so the result must equal a fault-free run of 6 steps on 2 ranks bit for bit: parameters,
optimizer state, BatchNorm's buffers. A step that failed mid-backward is reset first (without FSDP2's
reset_iter_state the module would hold unsharded parameters).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lockstep.engine.sharded import ShardPolicy, full_tensors, shard
from lockstep.engine.sharded.rebuild import ShardedState, meta_skeleton, move_optimizer, shard_again
from lockstep.runtime.env import env_contract as ec
from lockstep.testing import run_distributed

pytestmark = pytest.mark.fresh_ranks  # the ranks destroy and re-form their world

TIMEOUT = 240
STEPS, LOST_AFTER, K = 6, 3, 4
POLICY = ShardPolicy(shard_degree=2, deterministic=True)  # a 1-D mesh at any world: the sums are lockstep's
HSDP = ShardPolicy(shard_degree=2)  # FSDP2's HSDP: a 2-D mesh at 2 groups, a 1-D one at 1


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(12, 12), nn.BatchNorm1d(12), nn.Tanh()) for _ in range(3))
        )
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _batch(step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + k)
    return torch.randn(4, 12, generator=g), torch.randint(0, 3, (4,), generator=g)


def _step(handle: Any, optimizer: torch.optim.Optimizer, step: int) -> None:
    model = handle.module
    owned = handle.owned_micro_batches(K)

    def loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = nn.functional.cross_entropy(model(x), y)
        out.backward()
        return out.detach()

    handle.accumulate(loss, {k: _batch(step, k) for k in owned}, num_micro_batches=K, step=step)
    handle.clip_grad_norm_(1.0)  # the exact norm: a collective over each gradient's own mesh
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _start(policy: ShardPolicy) -> tuple[nn.Module, Any, torch.optim.Optimizer, nn.Module]:
    torch.manual_seed(0)
    model = _Net()
    skeleton = meta_skeleton(model)
    handle = shard(model, policy)
    return model, handle, torch.optim.AdamW(model.parameters(), lr=0.05), skeleton


def _result(handle: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = {k: v.detach().clone() for k, v in full_tensors(handle.module.state_dict()).items()}
    moments = [full_tensors(s["exp_avg"]).clone() for s in optimizer.state.values()]
    return {"state": state, "moments": moments, "steps": handle.stats().synced_steps}


def _fault_free(policy: ShardPolicy = POLICY) -> dict[str, Any]:
    _, handle, optimizer, _ = _start(policy)
    for step in range(STEPS):
        _step(handle, optimizer, step)
    return _result(handle, optimizer)


def _a_group_lost(lost: int, fail_mid_backward: bool, policy: ShardPolicy = POLICY) -> dict[str, Any] | None:
    _, handle, optimizer, skeleton = _start(policy)
    for step in range(LOST_AFTER):
        _step(handle, optimizer, step)
    if dist.get_rank() // 2 == lost:
        dist.barrier()  # the lost group leaves after the others are past their last collective with it
        return None
    new_rank = dist.get_rank() % 2  # the survivors renumbered: group 1's ranks 2, 3 become 0, 1
    if fail_mid_backward:
        _fail_mid_backward(handle.module)
    dist.barrier()
    state = ShardedState.take(handle, skeleton)
    for name, param in state.params.items():  # the local shards, not gathered ones (the reset resharded)
        assert isinstance(param, DTensor) and state.locals_[name].shape == param.to_local().shape, name
        assert state.locals_[name].shape[0] < param.shape[0] or param.shape[0] == 1, name
    dist.destroy_process_group()
    store = dist.TCPStore(
        os.environ[ec.MASTER_ADDR_VAR], int(os.environ[ec.MASTER_PORT_VAR]), 2, False, timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=dist.PrefixStore("rebuilt", store), rank=new_rank, world_size=2)
    rebuilt = shard_again(state, policy)
    for param in rebuilt.module.parameters():  # every parameter on the new world's shard group
        assert dist.get_process_group_ranks(param.device_mesh.get_group()) == [0, 1]
        assert param.device_mesh.get_group() is rebuilt.layout.shard_group
    move_optimizer(optimizer, state.params, rebuilt.module)
    assert all(p in optimizer.state for p in rebuilt.module.parameters())
    for step in range(LOST_AFTER, STEPS):
        _step(rebuilt, optimizer, step)
    return _result(rebuilt, optimizer)


def _fail_mid_backward(model: nn.Module) -> None:
    """A backward that raises half-way (after the head's gradients, before the last block's): FSDP2 is left
    mid-iteration, with unsharded parameters registered. BatchNorm in eval mode: its statistics unchanged."""

    def raise_in_backward(_module: nn.Module, _args: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda _grad: (_ for _ in ()).throw(RuntimeError("a peer died")))

    model.eval()
    hook = model.blocks[2].register_forward_hook(raise_in_backward)
    with pytest.raises(RuntimeError, match="a peer died"):
        model(_batch(99, 0)[0]).sum().backward()
    hook.remove()
    model.train()
    assert not all(isinstance(p, DTensor) for p in model.parameters())  # what the reset must undo


@pytest.mark.parametrize(
    "lost, fail_mid_backward",
    [(1, False), (1, True), (0, False)],
    ids=["group 1 lost", "group 1 lost mid-backward", "group 0 lost: the survivors renumbered"],
)
def test_the_surviving_group_rebuilt_on_a_new_world_ends_with_a_fault_free_runs_bits(
    lost: int, fail_mid_backward: bool
) -> None:
    """Group 0 lost: the survivors are renumbered, and every parameter's mesh resolves to the new shard
    group (the stale-mesh case of a world grown back to its old size is tests/cli/test_live_sharded.py's)."""
    reference = run_distributed(_fault_free, 2, timeout=TIMEOUT)[0]
    survived = run_distributed(_a_group_lost, 4, args=(lost, fail_mid_backward), timeout=TIMEOUT)
    assert survived[2 * lost] is None and survived[2 * lost + 1] is None
    for rank in (2 - 2 * lost, 3 - 2 * lost):
        got = survived[rank]
        assert got["state"].keys() == reference["state"].keys()
        for name, value in reference["state"].items():
            assert torch.equal(got["state"][name], value), (rank, name)
        assert len(got["moments"]) == len(reference["moments"])
        for mine, theirs in zip(got["moments"], reference["moments"], strict=True):
            assert torch.equal(mine, theirs)
        assert got["steps"] == STEPS  # the old handle's count carried on


def test_an_hsdp_group_rebuilt_on_one_group_moves_its_optimizer_state_onto_the_new_mesh() -> None:
    """FSDP2's HSDP: 2 groups make a 2-D mesh, the one left a 1-D mesh; the optimizer's state must take the
    new parameters' placements (the old ones on the new mesh failed the next optimizer step). Float sums:
    the weights close to a fault-free run on 2 ranks, not bitwise (the biases before BatchNorm have no
    gradient but rounding, which Adam turns into whole steps; the running statistics are rank 0's)."""
    reference = run_distributed(_fault_free, 2, args=(HSDP,), timeout=TIMEOUT)[0]
    survived = run_distributed(_a_group_lost, 4, args=(1, False, HSDP), timeout=TIMEOUT)
    for rank in (0, 1):
        got = survived[rank]
        assert got["steps"] == STEPS
        for name, value in reference["state"].items():
            if name.endswith("weight"):
                assert torch.allclose(got["state"][name], value, rtol=1e-4, atol=1e-5), (rank, name)
