"""The drop-in surface: state_dict keys, load_state_dict, attribute fall-through, comm hooks, replicate."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lockstep
from lockstep.errors import ConfigError
from lockstep.testing import run_distributed
from lockstep.testing.parity import run_parity
from tests.helpers import MLP, assert_close_lists, batch, build, case


def _surface() -> dict:
    rank = dist.get_rank()
    model = build("mlp", rank)
    ddp = lockstep.DistributedDataParallel(model)
    out: dict = {"keys": list(ddp.state_dict()), "forwarded": ddp.head is model.head}
    plain = MLP().state_dict()
    ddp.load_state_dict(plain)  # unprefixed
    out["unprefixed_loaded"] = torch.equal(model.fc1.weight, plain["fc1.weight"])
    ddp.load_state_dict({f"module.{k}": v * 2 for k, v in plain.items()})
    out["prefixed_loaded"] = torch.equal(model.fc1.weight, plain["fc1.weight"] * 2)
    assert isinstance(ddp.join(), torch.distributed.algorithms.join.Join)
    with pytest.raises(ConfigError, match="device_ids"):
        lockstep.DistributedDataParallel(MLP(), device_ids=[rank])
    # replicate: in place, keys unchanged, remove() stops communication
    module = build("mlp", rank)
    handle = lockstep.replicate(module)
    out["replicate_keys"] = list(module.state_dict())
    with pytest.raises(ConfigError, match="already replicated"):
        lockstep.replicate(module)
    handle.remove()
    x, y = batch(rank, 0)
    F.cross_entropy(module(x), y).backward()
    out["local_grad"] = module.head.bias.grad.clone()
    return out


def test_drop_in_surface() -> None:
    out = run_distributed(_surface, 2, timeout=60)
    for rank_out in out:
        assert rank_out["keys"][0] == "module.fc1.weight" and all(
            k.startswith("module.") for k in rank_out["keys"]
        )
        assert rank_out["forwarded"] and rank_out["unprefixed_loaded"] and rank_out["prefixed_loaded"]
        assert rank_out["replicate_keys"][0] == "fc1.weight"
    assert not torch.equal(out[0]["local_grad"], out[1]["local_grad"])  # removed: no averaging any more


class _Recorder:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group, self.seen = group, []


def _recording_hook(state, bucket):  # unannotated: torch checks annotations against its own types
    state.seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters()), len(bucket.gradients())))
    return default_hooks.allreduce_hook(state.group, bucket)


def _hooks(hook_name: str) -> dict:
    hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}[hook_name]
    out = {}
    for kind in ("ours", "torch"):
        out[kind] = _train_with_hook(kind, hook)
    for kind in ("ours", "torch"):
        out[f"recorded {kind}"] = _train_with_hook(
            kind, _recording_hook, _Recorder(None), bucket_cap_mb=0.0003
        )["seen"]
    return out


def _train_with_hook(kind: str, hook, state=None, **kwargs) -> dict:
    rank = dist.get_rank()
    module = build("many_small", rank)
    ddp = (lockstep.DistributedDataParallel if kind == "ours" else torch.nn.parallel.DistributedDataParallel)(
        module, **kwargs
    )
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    grads = []
    for step in range(3):
        x, y = batch(rank, step)
        F.cross_entropy(ddp(x), y).backward()
        grads.append([p.grad.clone() for p in module.parameters()])
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "seen": getattr(state, "seen", None)}


@pytest.mark.parametrize("hook_name", ["allreduce", "fp16"])
def test_torch_comm_hooks_run_unchanged(hook_name: str) -> None:
    out = run_distributed(_hooks, 2, args=(hook_name,), timeout=90)
    for rank_out in out:
        for step in range(3):
            assert_close_lists(rank_out["ours"]["grads"][step], rank_out["torch"]["grads"][step], atol=1e-6)
        # the hook sees torch's buckets: (index, is_last, parameters, gradients) per call, in torch's order
        seen = rank_out["recorded ours"]
        assert seen == rank_out["recorded torch"], (seen, rank_out["recorded torch"])
        assert seen[0] == (0, True, 28, 28)  # the first step: one bucket (many_small: 14 linear layers)
        per_step = (len(seen) - 1) // 2  # then rebuilt in the ready order into small buckets
        rebuilt = seen[1 : 1 + per_step]
        assert (
            per_step > 2
            and [s[0] for s in rebuilt] == list(range(per_step))
            and seen[1 + per_step :] == rebuilt
        )
        assert [s[1] for s in rebuilt] == [False] * (per_step - 1) + [True]
        assert sum(s[2] for s in rebuilt) == 28
        assert all(s[2] == s[3] for s in seen)


def test_user_initialised_process_group_and_world_of_one() -> None:
    # run_distributed's ranks call torch.distributed.init_process_group through lockstep.init(); a world of 1
    run_parity({"mlp": case("mlp", 2)}, 1, timeout=60)
