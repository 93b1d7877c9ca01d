"""The overlapped optimizer without a process group: a step taken in parts equals the whole step, bit for
bit; which optimizers and settings fall back and why; the wrapper refuses what would silently differ;
the fit setting and its `lockstep train` flag."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.optim.optimizer_steps import fallback_reason, overlap_plan
from lockstep.engine.optim.overlapped_optimizer import OverlappedOptimizer
from lockstep.errors import UsageError
from lockstep.trainer.settings.config import FitConfig
from lockstep.trainer.settings.config_sources import config_from_mapping, read_overrides

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_foreach_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 2))


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_in_parts_is_bitwise_the_whole_step(name: str) -> None:
    plain_model, parted_model = _model(), _model()
    plain = OPTIMIZERS[name](list(plain_model.parameters()))
    inner = OPTIMIZERS[name](list(parted_model.parameters()))
    parted = OverlappedOptimizer(inner, fallback=None)
    schedules = [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) for opt in (plain, parted)]
    params = list(parted_model.parameters())
    for step in range(5):
        _grads(plain_model, step)
        _grads(parted_model, step)
        plain.step()
        parted.step_params(params[4:])  # "buckets" in backward order
        parted.step_params(params[1:4])
        assert parted.pending
        parted.step()  # the rest: params[0]
        for schedule in schedules:
            schedule.step()
    for a, b in zip(plain_model.parameters(), parted_model.parameters()):
        assert torch.equal(a, b), name
    plain_state, parted_state = plain.state_dict()["state"], inner.state_dict()["state"]
    assert list(plain_state) == list(parted_state)  # the same order too: a checkpoint lists them alike
    for (ka, sa), (kb, sb) in zip(plain_state.items(), parted_state.items()):
        assert ka == kb and sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (name, ka, key)
    assert [g["lr"] for g in plain.param_groups] == [g["lr"] for g in inner.param_groups]
    assert all(len(g["params"]) == 6 for g in inner.param_groups)  # the groups are restored


def test_a_state_loaded_into_the_wrapped_optimizer_is_the_one_stepped_in_parts() -> None:
    # load_state_dict() gives an optimizer new param_groups and state objects: the wrapper must follow
    source_model, plain_model, parted_model = _model(), _model(), _model()
    source = torch.optim.Adam(source_model.parameters(), lr=1e-2)
    _grads(source_model, 0)
    source.step()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    inner = torch.optim.Adam(parted_model.parameters(), lr=1e-2)
    parted = OverlappedOptimizer(inner, fallback=None)
    plain.load_state_dict(copy.deepcopy(source.state_dict()))  # loading keeps the tensors it is given
    parted.load_state_dict(copy.deepcopy(source.state_dict()))
    assert parted.param_groups is inner.param_groups and parted.state is inner.state
    _grads(plain_model, 1)
    _grads(parted_model, 1)
    plain.step()
    parted.step_params(list(parted_model.parameters())[3:])
    parted.step()
    for a, b in zip(plain_model.parameters(), parted_model.parameters()):
        assert torch.equal(a, b)
    assert all(int(s["step"]) == 2 for s in inner.state.values())  # each parameter stepped once more


def test_hooks_registered_on_the_wrapper_are_the_wrapped_optimizers() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = OverlappedOptimizer(inner, fallback=None)
    steps: list[int] = []
    handle = opt.register_step_post_hook(
        lambda o, args, kwargs: steps.append(len(o.param_groups[0]["params"]))
    )
    opt.register_state_dict_pre_hook(lambda o: steps.append(-1))
    _grads(model, 0)
    opt.step_params(list(model.parameters())[4:])
    opt.step()
    assert steps == [2, 4]  # once per partial step of the wrapped optimizer, with its parameters then
    opt.state_dict()
    assert steps[-1] == -1
    handle.remove()
    assert not inner._optimizer_step_post_hooks


def _reason(optimizer: torch.optim.Optimizer, *, clip_grad_norm: bool, scaler: Any) -> str | None:
    """The fallback of `handle.overlap_optimizer(optimizer, ...)` on an all-reduce replica: its policy's
    plan with what the call says (optimizer_steps.overlap_plan)."""
    plan = overlap_plan(SyncPolicy().plan, clip_grad_norm=clip_grad_norm, scaler=scaler)
    return fallback_reason(optimizer, plan)


def test_fallback_reasons_name_what_needs_every_gradient() -> None:
    params = list(_model().parameters())
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        assert _reason(cls(params, lr=0.1), clip_grad_norm=False, scaler=None) is None
    rms = _reason(torch.optim.RMSprop(params), clip_grad_norm=False, scaler=None)
    assert rms is not None and "torch.optim.rmsprop.RMSprop" in rms and "does not know" in rms

    class MySGD(torch.optim.SGD):
        pass

    assert "MySGD" in str(_reason(MySGD(params, lr=0.1), clip_grad_norm=False, scaler=None))
    sgd = torch.optim.SGD(params, lr=0.1)
    assert "clipping by global norm" in str(_reason(sgd, clip_grad_norm=True, scaler=None))
    enabled, disabled = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu", enabled=False)
    assert "GradScaler's inf check" in str(_reason(sgd, clip_grad_norm=False, scaler=enabled))
    assert _reason(sgd, clip_grad_norm=False, scaler=disabled) is None


def test_a_fallback_says_why_once_and_steps_plainly() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = OverlappedOptimizer(inner, fallback="a reason", tag="[rank 0/2] ")
        opt.suspend("a reason")
        opt.suspend("another reason")
        opt.suspend("another reason")
    said = [str(w.message) for w in caught]
    assert said == [
        "[rank 0/2] overlap_optimizer: SGD takes the plain step after the whole backward, not bucket by "
        "bucket, because a reason",
        "[rank 0/2] overlap_optimizer: SGD takes the plain step after the whole backward, not bucket by "
        "bucket, because another reason",
    ]
    assert opt.fallback_reasons == ["a reason", "another reason"] and not opt.overlapped
    before = [p.detach().clone() for p in model.parameters()]
    _grads(model, 0)
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_gradient_changed_after_its_step_raises() -> None:
    model = _model()
    opt = OverlappedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), fallback=None)
    params = list(model.parameters())
    _grads(model, 0)
    opt.step_params(params[4:])
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with pytest.raises(UsageError, match=r"changed between backward\(\) and optimizer.step\(\)"):
        opt.step()
    opt.step_params(params[4:])
    params[4].grad = None  # zero_grad(set_to_none=True) before step(): the step already happened
    with pytest.raises(UsageError, match=r"of 1 parameter\(s\) changed"):
        opt.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_a_setting_changed_after_some_buckets_stepped_raises() -> None:
    # a scheduler stepped between backward() and step(): the plain step would use the new lr everywhere
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = OverlappedOptimizer(inner, fallback=None)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _grads(model, 0)
    opt.step_params(list(model.parameters())[4:])
    schedule.step()
    with pytest.raises(UsageError, match=r"lr of param_groups\[0\] changed between backward\(\)"):
        opt.step()
    _grads(model, 1)
    opt.step_params(list(model.parameters())[4:])
    opt.step()  # unchanged: fine
    schedule.step()


def test_the_wrapped_optimizer_stepped_directly_raises_while_buckets_are_stepped() -> None:
    model = _model()
    inner = torch.optim.Adam(model.parameters())
    opt = OverlappedOptimizer(inner, fallback=None)
    _grads(model, 0)
    inner.step()  # nothing stepped by the engine: a plain step, allowed
    opt.step_params(list(model.parameters())[4:])
    with pytest.raises(UsageError, match="would step them twice"):
        inner.step()
    with pytest.raises(UsageError, match="a synced backward began before optimizer.step"):
        opt.check_no_pending()
    opt.step()
    opt.check_no_pending()


def test_fit_setting_and_its_flag() -> None:
    assert FitConfig().overlap_optimizer is False
    values, sources = read_overrides(["--overlap-optimizer", "true"], switches={"overlap_optimizer"})
    assert config_from_mapping(FitConfig, values, sources).overlap_optimizer is True
    values, sources = read_overrides(["--overlap-optimizer"], switches={"overlap_optimizer"})
    assert config_from_mapping(FitConfig, values, sources).overlap_optimizer is True


def test_a_plain_optimizer_is_stepped_as_whole_parameters_chosen_once() -> None:
    from lockstep.engine.optim.shard_overlap import WholeParams

    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = OverlappedOptimizer(inner, fallback=None)
    whole = opt.params_stepped
    assert isinstance(whole, WholeParams) and whole.optimizer is inner
    assert opt.consolidate_state_dict is None and opt.state is inner.state  # nothing sharded
    assert not whole.in_flight() and whole.stats() == {} and not whole.abandon()  # nothing to broadcast
    assert whole.mine() == {id(p) for p in model.parameters()}
    _grads(model, 0)
    opt.step_params(list(model.parameters())[4:])
    opt.step()
    assert opt.params_stepped is whole
    assert all(g["params"] is not None for g in inner.param_groups)
    assert [id(p) for p in inner.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
