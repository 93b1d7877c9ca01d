"""Drop-in behaviours that real programs rely on, each compared with torch's own DDP on real gloo ranks.

Every training case runs lockstep.DistributedDataParallel and torch.nn.parallel.DistributedDataParallel
from the same initial weights (different per rank before the wrap: the wrap must broadcast rank 0's) on
the same per-rank batches and asserts BIT-FOR-BIT equal gradients: in a world of 2, scaling by 1/2 is
exact and a sum of two values does not depend on their order, so both engines must agree exactly.
Replicas are compared across ranks in the parent, and where the loss is a mean over samples, one process
on the concatenated batch is the reference as well (within float tolerance).

Starting ranks costs more than the checks, so each test launches once and runs several cases.

No `from __future__ import annotations` in this file: the communication hooks below are checked for
their annotations with inspect.signature (torch's rules), which must see real objects, not strings.
"""

import copy
import dataclasses
import io
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import lockstep
from lockstep.testing import run_distributed, watch_collectives
from tests.helpers import (
    BATCH,
    IN,
    MLP,
    OUT,
    WithUnused,
    assert_close_lists,
    batch,
    grads_of,
    params_of,
)

KINDS = ("ours", "torch")
WORLD = 2

LossOfStep = Callable[[nn.Module, int], Tensor]


# ---------------------------------------------------------------------------------------------- helpers


def _ddp(kind: str, module: nn.Module, **kwargs: Any) -> TorchDDP:
    cls = lockstep.DistributedDataParallel if kind == "ours" else TorchDDP
    return cls(module, **kwargs)


def _seeded(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def _train(
    model: nn.Module,
    module: nn.Module,
    loss_of_step: LossOfStep,
    steps: int,
    *,
    lr: float = 0.05,
    momentum: float = 0.9,
) -> dict[str, Any]:
    """`steps` SGD steps: the gradients after each backward and the parameters at the end."""
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    grads = []
    for step in range(steps):
        loss_of_step(model, step).backward()
        grads.append(grads_of(module))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": grads, "params": params_of(module)}


def _single(
    factory: Callable[[], nn.Module], loss_of_step: LossOfStep, steps: int, **kw: Any
) -> dict[str, Any]:
    """One process, rank 0's initial weights, the concatenated batch of all ranks."""
    module = _seeded(factory, 0)
    return _train(module, module, loss_of_step, steps, **kw)


def _ce(rank: int, offset: int = 0) -> LossOfStep:
    def loss(model: nn.Module, step: int) -> Tensor:
        x, y = batch(rank, offset + step)
        return F.cross_entropy(model(x), y)

    return loss


def _global(step: int) -> tuple[Tensor, Tensor]:
    parts = [batch(r, step) for r in range(WORLD)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _raised(fn: Callable[[], Any]) -> dict[str, Any] | None:
    """What fn raised (class names along the MRO and the message), or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parent checks the type against torch's
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    return None


def _assert_raised(info: dict[str, Any] | None, exc_type: type, pattern: str, what: str) -> None:
    assert info is not None, f"{what}: nothing was raised"
    assert exc_type.__name__ in info["types"], (
        f"{what}: raised {info['types'][0]}, not a {exc_type.__name__}: {info}"
    )
    assert re.search(pattern, info["message"]), (
        f"{what}: message {info['message']!r} does not match {pattern!r}"
    )


def _assert_same(a: list[Any], b: list[Any], what: str) -> None:
    """Bit for bit: None where the other is None, sparse gradients compared coalesced (indices and values)."""
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} tensors"
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, (
                f"{what}[{i}]: None on one side only (left {x is None}, right {y is None})"
            )
            continue
        assert x.is_sparse == y.is_sparse, f"{what}[{i}]: sparse {x.is_sparse} vs {y.is_sparse}"
        if x.is_sparse:
            x, y = x.coalesce(), y.coalesce()
            assert torch.equal(x.indices(), y.indices()), f"{what}[{i}]: sparse indices differ"
            x, y = x.values(), y.values()
        assert x.shape == y.shape and x.dtype == y.dtype, (
            f"{what}[{i}]: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
        )
        assert torch.equal(x, y), (
            f"{what}[{i}]: not bit-for-bit equal, max |diff| {(x - y).abs().max().item():.3g}"
        )


def _assert_runs_same(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    assert len(ours["grads"]) == len(theirs["grads"]), what
    for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
        _assert_same(a, b, f"{what}: grads of step {step}, lockstep vs torch")
    _assert_same(ours["params"], theirs["params"], f"{what}: params, lockstep vs torch")


def _assert_replicas(out: list[Any], pick: Callable[[Any], list[Any]], what: str) -> None:
    for rank in range(1, len(out)):
        _assert_same(pick(out[rank]), pick(out[0]), f"{what}: rank {rank} vs rank 0")


def _assert_close_run(ours: dict[str, Any], single: dict[str, Any], what: str) -> None:
    for step, (a, b) in enumerate(zip(ours["grads"], single["grads"])):
        assert_close_lists(a, b, atol=1e-6, rtol=1e-5, what=f"{what}: grads of step {step} vs single process")
    assert_close_lists(
        ours["params"], single["params"], atol=1e-6, rtol=1e-5, what=f"{what}: params vs single"
    )


# ------------------------------------------------------------- 1 + 3: gradient penalty, double backward


class Critic(nn.Module):
    """tanh everywhere: the penalty's second derivatives are not zero."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


PENALTY_STEPS = 3


def _penalty_loss(model: nn.Module, x: Tensor) -> Tensor:
    """WGAN-GP / R1: the gradient of the output with respect to the input, penalised, in the loss."""
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + ((g.norm(2, dim=1) - 1) ** 2).mean()


def _penalty_on_rank(rank: int) -> LossOfStep:
    return lambda model, step: _penalty_loss(model, batch(rank, step)[0])


def _penalty_and_double_backward() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for find_unused in (False, True):
        for kind in KINDS:
            module = _seeded(Critic, rank)
            model = _ddp(kind, module, find_unused_parameters=find_unused)
            out[f"penalty {kind} find_unused={find_unused}"] = _train(
                model, module, _penalty_on_rank(rank), PENALTY_STEPS
            )
    for kind in KINDS:
        out[f"double {kind}"] = _double_backward(kind)
    # torch's reference for the first-order gradients: the same forward with a plain backward
    module = _seeded(Critic, rank)
    model = TorchDDP(module)
    model(batch(rank, 0)[0]).pow(2).mean().backward()
    out["plain torch first"] = grads_of(module)
    module.zero_grad(set_to_none=True)
    out["plain torch after"] = _train(model, module, _mse_critic(rank), 2)
    out["manual double"] = _manual_double_backward()
    return out


def _mse_critic(rank: int) -> LossOfStep:
    def loss(model: nn.Module, step: int) -> Tensor:
        x, y = batch(rank, 50 + step)
        return F.mse_loss(model(x).squeeze(1), y.float())

    return loss


def _double_backward(kind: str) -> dict[str, Any]:
    """backward(create_graph=True), then a gradient-norm penalty of p.grad backpropagated again."""
    rank = dist.get_rank()
    module = _seeded(Critic, rank)
    model = _ddp(kind, module)
    res: dict[str, Any] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(batch(rank, 0)[0]).pow(2).mean().backward(create_graph=True)
    except RuntimeError as exc:
        return {"error": str(exc)}
    res["first"] = [p.grad.detach().clone() for p in module.parameters()]
    res["first has graph"] = [p.grad.requires_grad for p in module.parameters()]
    grad_norm = sum(p.grad.pow(2).sum() for p in module.parameters())
    grad_norm.backward()
    res["second"] = [p.grad.detach().clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    res["after"] = _train(model, module, _mse_critic(rank), 2)  # the wrapper still trains normally after it
    return res


def _manual_double_backward() -> list[Tensor]:
    """What torch's DDP states for create_graph=True (its warning: first-order gradients averaged, "the
    higher-order gradient will not be synchronized across ranks, and backpropagation through all_reduce
    operations will not occur"), written out without DDP."""
    rank = dist.get_rank()
    module = _seeded(Critic, 0)  # rank 0's weights: what the wrap broadcasts
    module(batch(rank, 0)[0]).pow(2).mean().backward(create_graph=True)
    with torch.no_grad():
        for p in module.parameters():
            total = p.grad.detach().clone()
            dist.all_reduce(total)
            p.grad.copy_(total / WORLD)
    grad_norm = sum(p.grad.pow(2).sum() for p in module.parameters())
    grad_norm.backward()
    return [p.grad.detach().clone() for p in module.parameters()]


def test_gradient_penalty_and_double_backward_match_torch() -> None:
    out = run_distributed(_penalty_and_double_backward, WORLD, timeout=90)
    single = _single(Critic, lambda model, step: _penalty_loss(model, _global(step)[0]), PENALTY_STEPS)
    # 1. gradient penalty: bit for bit with torch's DDP, identical replicas, the single-process result
    for find_unused in (False, True):
        key = f"find_unused={find_unused}"
        for rank, by_case in enumerate(out):
            _assert_runs_same(
                by_case[f"penalty ours {key}"], by_case[f"penalty torch {key}"], f"rank {rank} penalty {key}"
            )
            _assert_close_run(by_case[f"penalty ours {key}"], single, f"rank {rank} penalty {key}")
        _assert_replicas(
            out, lambda by_case, key=key: by_case[f"penalty ours {key}"]["params"], f"penalty {key}"
        )
    # 3. backward(create_graph=True): torch 2.13's DDP raises on CPU/gloo in every configuration
    # ("a leaf Variable that requires grad is being used in an in-place operation."); where it does
    # not, lockstep must equal it; otherwise the references are torch's DDP with a plain backward (first
    # order) and torch's stated semantics written out by hand (second order, local).
    for rank, by_case in enumerate(out):
        ours, theirs = by_case["double ours"], by_case["double torch"]
        assert "error" not in ours, f"rank {rank}: backward(create_graph=True) failed: {ours['error']}"
        first_ref = theirs["first"] if "error" not in theirs else by_case["plain torch first"]
        _assert_same(ours["first"], first_ref, f"rank {rank} create_graph first-order grads vs torch")
        assert all(ours["first has graph"]), f"rank {rank}: p.grad lost its graph: {ours['first has graph']}"
        if "error" not in theirs:
            _assert_same(ours["second"], theirs["second"], f"rank {rank} second backward vs torch")
        _assert_same(
            ours["second"], by_case["manual double"], f"rank {rank} second backward vs local reference"
        )
        _assert_runs_same(
            ours["after"], by_case["plain torch after"], f"rank {rank} training after create_graph"
        )
    _assert_replicas(out, lambda by_case: by_case["double ours"]["first"], "create_graph first-order grads")
    _assert_replicas(
        out, lambda by_case: by_case["double ours"]["after"]["params"], "params after create_graph"
    )


# ------------------------------------------ 2 + 4 + 12: accumulation by flag, several forwards, dropped ones

ACCUM, ACCUM_STEPS = 4, 3


def _accumulate_by_flag(kind: str) -> dict[str, Any]:
    """nanoGPT: `model.require_backward_grad_sync = (micro_step == accum - 1)`."""
    rank = dist.get_rank()
    module = _seeded(MLP, rank)
    model = _ddp(kind, module)
    res: dict[str, Any] = {
        "flags after init": (model.require_backward_grad_sync, model.require_forward_param_sync)
    }
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    grads, calls, forward_flags = [], [], []
    for step in range(ACCUM_STEPS):
        for micro in range(ACCUM):
            model.require_backward_grad_sync = micro == ACCUM - 1
            x, y = batch(rank, step * ACCUM + micro)
            seen: list[Tensor] = []
            with watch_collectives(seen.append):
                loss = F.cross_entropy(model(x), y) / ACCUM
                forward_flags.append(model.require_forward_param_sync)
                loss.backward()
            calls.append(len(seen))
        grads.append(grads_of(module))
        opt.step()
        opt.zero_grad(set_to_none=True)
    res.update(
        grads=grads,
        params=params_of(module),
        calls=calls,
        forward_flags=forward_flags,
        flag_at_end=model.require_backward_grad_sync,
    )
    return res


def _accumulate_single() -> dict[str, Any]:
    module = _seeded(MLP, 0)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(ACCUM_STEPS):
        for micro in range(ACCUM):
            x, y = _global(step * ACCUM + micro)
            (F.cross_entropy(module(x), y) / ACCUM).backward()
        grads.append(grads_of(module))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": grads, "params": params_of(module)}


def _siamese_loss(x1: Tensor, x2: Tensor, model: nn.Module) -> Tensor:
    a, b = model(x1), model(x2)  # two forwards, one backward
    return (a - b).pow(2).mean() + torch.tanh(a).mean()


def _siamese(rank: int) -> LossOfStep:
    return lambda model, step: _siamese_loss(batch(rank, step)[0], batch(rank, 100 + step)[0], model)


def _probe_then_ce(rank: int) -> LossOfStep:
    def loss(model: nn.Module, step: int) -> Tensor:
        model(
            batch(rank, 500 + step)[0]
        )  # an eval-like forward with grad enabled: output dropped, no backward
        x, y = batch(rank, step)
        return F.cross_entropy(model(x), y)

    return loss


DROPPED = 4


def _dropped_then_train(kind: str, find_unused: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    module = _seeded(WithUnused if find_unused else MLP, rank)  # WithUnused: `spare` is never used
    model = _ddp(kind, module, find_unused_parameters=find_unused)
    for i in range(DROPPED):
        model(batch(rank, 200 + i)[0])
    return _train(model, module, _ce(rank), 4)


def _accumulation_and_extra_forwards() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for kind in KINDS:
        out[f"accum {kind}"] = _accumulate_by_flag(kind)
        for find_unused in (False, True):
            module = _seeded(MLP, rank)
            model = _ddp(kind, module, find_unused_parameters=find_unused)
            out[f"siamese {kind} {find_unused}"] = _train(model, module, _siamese(rank), 3)
            module = _seeded(MLP, rank)
            model = _ddp(kind, module, find_unused_parameters=find_unused)
            out[f"probe {kind} {find_unused}"] = _train(model, module, _probe_then_ce(rank), 3)
            out[f"dropped {kind} {find_unused}"] = _dropped_then_train(kind, find_unused)
    return out


def test_accumulation_by_flag_several_forwards_and_dropped_outputs_match_torch() -> None:
    out = run_distributed(_accumulation_and_extra_forwards, WORLD, timeout=90)
    accum_single = _accumulate_single()
    siamese_single = _single(
        MLP,
        lambda model, step: _siamese_loss(
            torch.cat([batch(r, step)[0] for r in range(WORLD)]),
            torch.cat([batch(r, 100 + step)[0] for r in range(WORLD)]),
            model,
        ),
        3,
    )
    probe_single = _single(
        MLP, lambda model, step: F.cross_entropy(model(_global(step)[0]), _global(step)[1]), 3
    )
    non_final = [i for i in range(ACCUM * ACCUM_STEPS) if i % ACCUM != ACCUM - 1]
    final = [i for i in range(ACCUM * ACCUM_STEPS) if i % ACCUM == ACCUM - 1]
    for rank, by_case in enumerate(out):
        # 2. accumulation by flag
        ours, theirs = by_case["accum ours"], by_case["accum torch"]
        _assert_runs_same(ours, theirs, f"rank {rank} accumulation by flag")
        _assert_close_run(ours, accum_single, f"rank {rank} accumulation by flag")
        assert ours["flags after init"] == theirs["flags after init"] == (True, True), (
            ours["flags after init"],
            theirs["flags after init"],
        )
        assert ours["forward_flags"] == theirs["forward_flags"], (
            ours["forward_flags"],
            theirs["forward_flags"],
        )
        assert ours["flag_at_end"] is True
        assert [ours["calls"][i] for i in non_final] == [0] * len(non_final), f"rank {rank}: {ours['calls']}"
        assert all(ours["calls"][i] > 0 for i in final), (
            f"rank {rank}: synced micro-steps sent nothing: {ours['calls']}"
        )
        # 4. several forwards before one backward; a forward without backward before each step
        for find_unused in (False, True):
            _assert_runs_same(
                by_case[f"siamese ours {find_unused}"],
                by_case[f"siamese torch {find_unused}"],
                f"rank {rank} siamese find_unused={find_unused}",
            )
            _assert_close_run(by_case[f"siamese ours {find_unused}"], siamese_single, f"rank {rank} siamese")
            _assert_runs_same(
                by_case[f"probe ours {find_unused}"],
                by_case[f"probe torch {find_unused}"],
                f"rank {rank} dropped forward before each step find_unused={find_unused}",
            )
            _assert_close_run(by_case[f"probe ours {find_unused}"], probe_single, f"rank {rank} probe")
            # 12. four forwards with their outputs dropped, then training
            _assert_runs_same(
                by_case[f"dropped ours {find_unused}"],
                by_case[f"dropped torch {find_unused}"],
                f"rank {rank} {DROPPED} dropped forwards find_unused={find_unused}",
            )
        assert by_case["dropped ours True"]["grads"][0][4] is None  # WithUnused.spare: never used, stays None
    for case in (
        "accum ours",
        "siamese ours False",
        "siamese ours True",
        "probe ours False",
        "probe ours True",
        "dropped ours False",
        "dropped ours True",
    ):
        _assert_replicas(out, lambda by_case, case=case: by_case[case]["params"], case)


# ------------------------------------------------ 5 + 13 + 14: teacher/student, dataclass output, unused


def _teacher_student(kind: str) -> dict[str, Any]:
    """DINO-style: the teacher is a second wrapper around a deep copy of the student's module, frozen after
    the wrap, its output the target (under no_grad, or with grad enabled and detached), updated by EMA."""
    rank = dist.get_rank()
    student_module = _seeded(MLP, rank)
    student = _ddp(kind, student_module)
    teacher = _ddp(kind, copy.deepcopy(student.module))
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(student_module.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(4):
        x, y = batch(rank, step)
        if step % 2 == 0:
            with torch.no_grad():
                target = teacher(x)
        else:
            target = teacher(x).detach()
        logits = student(x)
        loss = F.kl_div(F.log_softmax(logits, -1), F.softmax(target / 0.5, -1), reduction="batchmean")
        (loss + F.cross_entropy(logits, y)).backward()
        grads.append(grads_of(student_module))
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for t, s in zip(teacher.module.parameters(), student_module.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
    return {"grads": grads, "params": params_of(student_module), "teacher": params_of(teacher.module)}


@dataclasses.dataclass
class Out:
    a: Tensor | None
    b: dict


class DataclassNet(nn.Module):
    """Returns a dataclass holding an optional tensor and a dict with a nested list."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, 16)
        self.fa = nn.Linear(16, OUT)
        self.fb = nn.Linear(16, OUT)
        self.fc = nn.Linear(16, 1)
        self.use_a = True

    def forward(self, x: Tensor) -> Out:
        h = torch.tanh(self.trunk(x))
        return Out(a=self.fa(h) if self.use_a else None, b={"logits": self.fb(h), "aux": [self.fc(h)]})


def _dataclass_run(kind: str) -> dict[str, Any]:
    rank = dist.get_rank()
    module = _seeded(DataclassNet, rank)
    model = _ddp(kind, module, find_unused_parameters=True)

    def loss(model: nn.Module, step: int) -> Tensor:
        module.use_a = step % 2 == 0  # odd steps: `a` is None, `fa` unused on every rank
        x, y = batch(rank, step)
        out = model(x)
        total = F.cross_entropy(out.b["logits"], y) + out.b["aux"][0].pow(2).mean()
        return total + F.cross_entropy(out.a, y) if out.a is not None else total

    return _train(model, module, loss, 4)


class TwoTowers(nn.Module):
    """Rank r uses tower t{r}; `u` is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 16)
        self.t0 = nn.Linear(16, 16)
        self.t1 = nn.Linear(16, 16)
        self.u = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT)
        self.tower = 0

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(torch.tanh(getattr(self, f"t{self.tower}")(h)))


TOWER_T0, TOWER_T1, TOWER_U = (2, 3), (4, 5), (6, 7)  # parameter indices (weight, bias)


def _two_towers(kind: str) -> dict[str, Any]:
    rank = dist.get_rank()
    module = _seeded(TwoTowers, rank)
    module.tower = rank
    model = _ddp(kind, module, find_unused_parameters=True)
    return _train(model, module, _ce(rank), 3)


def _teacher_dataclass_unused() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        out[f"teacher {kind}"] = _teacher_student(kind)
        out[f"dataclass {kind}"] = _dataclass_run(kind)
        out[f"towers {kind}"] = _two_towers(kind)
    return out


def test_teacher_student_dataclass_output_and_locally_unused_match_torch() -> None:
    out = run_distributed(_teacher_dataclass_unused, WORLD, timeout=90)
    for rank, by_case in enumerate(out):
        # 5. teacher/student
        _assert_runs_same(by_case["teacher ours"], by_case["teacher torch"], f"rank {rank} teacher/student")
        _assert_same(
            by_case["teacher ours"]["teacher"], by_case["teacher torch"]["teacher"], f"rank {rank} teacher"
        )
        # 13. dataclass output, one branch None on odd steps
        ours = by_case["dataclass ours"]
        _assert_runs_same(ours, by_case["dataclass torch"], f"rank {rank} dataclass output")
        assert ours["grads"][0][2] is not None and ours["grads"][1][2] is None  # fa.weight: used, then not
        # 14. locally unused (t0 on rank 1, t1 on rank 0) vs globally unused (u)
        ours = by_case["towers ours"]
        _assert_runs_same(ours, by_case["towers torch"], f"rank {rank} two towers")
        for step, grads in enumerate(ours["grads"]):
            for i in TOWER_T0 + TOWER_T1:
                assert grads[i] is not None and grads[i].abs().sum() > 0, f"rank {rank} step {step} param {i}"
            assert all(grads[i] is None for i in TOWER_U), f"rank {rank} step {step}: u.grad is not None"
    for case in ("teacher ours", "dataclass ours", "towers ours"):
        _assert_replicas(out, lambda by_case, case=case: by_case[case]["params"], case)
        _assert_replicas(out, lambda by_case, case=case: by_case[case]["grads"][-1], f"{case} last grads")
    _assert_replicas(out, lambda by_case: by_case["teacher ours"]["teacher"], "teacher")


# ---------------------------------------------------------------------------------- 7: pickling and copies


def _lockstep_traces(module: nn.Module) -> list[str]:
    """Attributes of the module (and hooks in its hook dicts) that belong to lockstep."""
    found = []
    for name, value in vars(module).items():
        if "lockstep" in name.lower() or type(value).__module__.startswith("lockstep"):
            found.append(name)
        elif isinstance(value, dict) and not name.startswith(("_parameters", "_buffers", "_modules")):
            for hook in value.values():
                owner = getattr(hook, "__self__", hook)
                if type(owner).__module__.startswith("lockstep") or str(
                    getattr(hook, "__module__", "")
                ).startswith("lockstep"):
                    found.append(f"{name}[{hook!r}]")
    return found


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _copies(kind: str) -> dict[str, Any]:
    rank = dist.get_rank()
    module = _seeded(MLP, rank)
    ddp = _ddp(kind, module)
    res: dict[str, Any] = {"before": _train(ddp, module, _ce(rank), 1)}  # the engine has run once
    res["traces"] = sorted({t for m in module.modules() for t in _lockstep_traces(m)})
    snapshot = params_of(module)
    copies = {
        "pickle": pickle.loads(pickle.dumps(ddp)),
        "torch.save": _roundtrip(ddp),
        "deepcopy": copy.deepcopy(ddp),
    }
    saved = _roundtrip(ddp.module)
    res["saved module"] = {k: v.clone() for k, v in saved.state_dict().items()}
    res["module state"] = {k: v.clone() for k, v in module.state_dict().items()}
    fresh = copy.deepcopy(ddp.module)
    res["copy param hooks"] = [
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in fresh.parameters()
    ]
    copies["rewrapped"] = _ddp(kind, fresh)
    for name, wrapper in copies.items():
        res[f"{name} isinstance"] = isinstance(wrapper, type(ddp))
        res[f"{name} shares params"] = any(
            a.data_ptr() == b.data_ptr() for a, b in zip(wrapper.module.parameters(), module.parameters())
        )
        res[name] = _train(wrapper, wrapper.module, _ce(rank, offset=10), 3)
    res["original untouched"] = all(torch.equal(a, b) for a, b in zip(params_of(module), snapshot))
    res["original after"] = _train(ddp, module, _ce(rank, offset=20), 2)  # the original still trains
    return res


def _pickling() -> dict[str, Any]:
    return {kind: _copies(kind) for kind in KINDS}


def test_pickle_torch_save_deepcopy_and_rewrap_train_like_torch() -> None:
    out = run_distributed(_pickling, WORLD, timeout=90)
    names = ("pickle", "torch.save", "deepcopy", "rewrapped")
    for rank, by_kind in enumerate(out):
        ours, theirs = by_kind["ours"], by_kind["torch"]
        assert ours["traces"] == [], f"rank {rank}: lockstep left {ours['traces']} on the user's module"
        assert ours["copy param hooks"] == theirs["copy param hooks"], (
            ours["copy param hooks"],
            theirs["copy param hooks"],
        )
        assert list(ours["saved module"]) == list(ours["module state"])
        _assert_same(
            list(ours["saved module"].values()), list(ours["module state"].values()), "torch.save(module)"
        )
        _assert_runs_same(ours["before"], theirs["before"], f"rank {rank} before copying")
        for name in names:
            assert ours[f"{name} isinstance"] and not ours[f"{name} shares params"], f"rank {rank} {name}"
            _assert_runs_same(ours[name], theirs[name], f"rank {rank} trained copy ({name})")
        assert ours["original untouched"], f"rank {rank}: training a copy changed the original"
        _assert_runs_same(
            ours["original after"], theirs["original after"], f"rank {rank} original after copies"
        )
    for name in (*names, "original after"):
        _assert_replicas(out, lambda by_kind, name=name: by_kind["ours"][name]["params"], f"copy {name}")
        _assert_replicas(
            out, lambda by_kind, name=name: by_kind["ours"][name]["grads"][-1], f"copy {name} grads"
        )


# ------------------------------------------------------------------------------------ 8: sparse gradients

VOCAB = 40  # 20 tokens a rank: rows repeat within and across ranks, and some rows get no gradient


class SparseNet(nn.Module):
    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.emb = (
            nn.EmbeddingBag(VOCAB, 8, mode="mean", sparse=True)
            if bag
            else nn.Embedding(VOCAB, 8, sparse=True)
        )
        self.head = nn.Linear(8, OUT)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx) if self.bag else self.emb(idx).mean(1)
        return self.head(h)


def _tokens(rank: int, step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(7000 + 1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, 5), generator=gen), torch.randint(0, OUT, (BATCH,), generator=gen)


def _halving_hook(state, bucket):  # unannotated; module level (picklable)
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] / 2)


SPARSE_CASES = [
    (bag, as_view, hook)
    for bag in (False, True)
    for as_view, hook in ((False, False), (True, False), (False, True))
]


def _sparse_run(kind: str, bag: bool, as_view: bool, hook: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    module = _seeded(lambda: SparseNet(bag), rank)
    model = _ddp(kind, module, gradient_as_bucket_view=as_view)
    if hook:
        model.register_comm_hook(None, _halving_hook)

    def loss(model: nn.Module, step: int) -> Tensor:
        idx, y = _tokens(rank, step)
        return F.cross_entropy(model(idx), y)

    res = _train(model, module, loss, 3, lr=0.1, momentum=0.0)  # SGD with momentum refuses sparse gradients
    res["is_sparse"] = [g[0].is_sparse for g in res["grads"]]
    return res


def _sparse() -> dict[str, Any]:
    return {(kind, *case): _sparse_run(kind, *case) for case in SPARSE_CASES for kind in KINDS}


def test_sparse_embedding_gradients_match_torch() -> None:
    out = run_distributed(_sparse, WORLD, timeout=90)
    for case in SPARSE_CASES:
        what = "bag={} gradient_as_bucket_view={} hook={}".format(*case)
        for rank, by_case in enumerate(out):
            ours, theirs = by_case[("ours", *case)], by_case[("torch", *case)]
            assert ours["is_sparse"] == theirs["is_sparse"] == [True] * 3, (
                what,
                ours["is_sparse"],
                theirs["is_sparse"],
            )
            _assert_runs_same(ours, theirs, f"rank {rank} sparse {what}")
        _assert_replicas(out, lambda by_case, case=case: by_case[("ours", *case)]["params"], f"sparse {what}")
        _assert_replicas(
            out, lambda by_case, case=case: by_case[("ours", *case)]["grads"][-1], f"sparse {what} grads"
        )


# ---------------------------------------------- 6 + 9: isinstance, state dicts, torch's attributes, mesh


def _surface() -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _get_default_group

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for kind in KINDS:
        res: dict[str, Any] = {}
        module = _seeded(MLP, rank)
        ddp = _ddp(kind, module)
        res["isinstance"] = isinstance(ddp, TorchDDP)
        res["default group"] = ddp.process_group is not None and ddp.process_group == _get_default_group()
        res["bucket_bytes_cap"] = ddp.bucket_bytes_cap
        res["bucket_bytes_cap 1 MB"] = _ddp(kind, _seeded(MLP, rank), bucket_cap_mb=1).bucket_bytes_cap
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        _ce(rank)(ddp, 0).backward()
        opt.step()
        model_sd, optim_sd = get_state_dict(ddp, opt)
        res["dcp model keys"] = list(model_sd)
        res["dcp model values"] = [v.detach().clone() for v in model_sd.values()]
        res["module values"] = [v.detach().clone() for v in module.state_dict().values()]
        res["dcp optim state keys"] = sorted(optim_sd["state"])
        res["dcp optim group params"] = [list(g["params"]) for g in optim_sd["param_groups"]]
        res["state_dict keys"] = list(ddp.state_dict())
        _ce(rank)(ddp, 1).backward()  # the second forward rebuilds the buckets
        res["rebuilt"] = ddp._has_rebuilt_buckets
        res["module parameters"] = [p is q for p, q in zip(ddp._module_parameters, module.parameters())]
        # `reducer` answers what frameworks call (tests/multiproc/test_torch_reducer.py); `logger` is internal
        res["logger"] = _raised(
            lambda ddp=ddp, kind=kind: ddp.logger if kind == "ours" else ddp.no_such_attribute
        )
        # _set_static_graph() before training: like static_graph=True
        static_module = _seeded(WithUnused, rank)
        static = _ddp(kind, static_module)
        static._set_static_graph()
        res["static"] = _train(static, static_module, _ce(rank), 3)
        ctor_module = _seeded(WithUnused, rank)
        res["static ctor"] = _train(_ddp(kind, ctor_module, static_graph=True), ctor_module, _ce(rank), 3)
        # a 1-D CPU device mesh instead of a process group
        mesh_module = _seeded(MLP, rank)
        meshed = _ddp(kind, mesh_module, device_mesh=mesh)
        res["mesh group"] = meshed.process_group is not None and meshed.process_group == mesh.get_group(0)
        res["mesh"] = _train(meshed, mesh_module, _ce(rank), 2)
        res["group and mesh"] = _raised(
            lambda kind=kind: _ddp(kind, MLP(), process_group=_get_default_group(), device_mesh=mesh)
        )
        out[kind] = res
    dist.barrier()
    return out


def test_isinstance_state_dicts_and_torch_attributes() -> None:
    out = run_distributed(_surface, WORLD, timeout=90)
    for rank, by_kind in enumerate(out):
        ours, theirs = by_kind["ours"], by_kind["torch"]
        # 6. isinstance, distributed checkpoint's state dict, ddp.state_dict()
        assert ours["isinstance"] and theirs["isinstance"]
        assert ours["dcp model keys"] == theirs["dcp model keys"], (
            ours["dcp model keys"],
            theirs["dcp model keys"],
        )
        assert not any(k.startswith("module.") for k in ours["dcp model keys"]), ours["dcp model keys"]
        _assert_same(ours["dcp model values"], ours["module values"], f"rank {rank} get_state_dict values")
        _assert_same(
            ours["dcp model values"], theirs["dcp model values"], f"rank {rank} get_state_dict vs torch"
        )
        assert ours["dcp optim state keys"] == theirs["dcp optim state keys"], (
            ours["dcp optim state keys"],
            theirs["dcp optim state keys"],
        )
        assert ours["dcp optim group params"] == theirs["dcp optim group params"]
        assert ours["state_dict keys"] == theirs["state_dict keys"], (
            ours["state_dict keys"],
            theirs["state_dict keys"],
        )
        # 9. torch's attributes; the C++ reducer's internals are named as such, not blamed on the module
        assert ours["rebuilt"] and theirs["rebuilt"]
        assert ours["module parameters"] == theirs["module parameters"] == [True] * 6
        _assert_raised(
            ours["logger"],
            AttributeError,
            "'logger': it is an internal of torch's C\\+\\+ DDP",
            "lockstep reducer",
        )
        assert ours["default group"] and theirs["default group"]
        assert ours["bucket_bytes_cap"] == theirs["bucket_bytes_cap"], (
            ours["bucket_bytes_cap"],
            theirs["bucket_bytes_cap"],
        )
        assert ours["bucket_bytes_cap 1 MB"] == theirs["bucket_bytes_cap 1 MB"] == 1024 * 1024
        _assert_runs_same(ours["static"], theirs["static"], f"rank {rank} _set_static_graph()")
        _assert_runs_same(
            ours["static"], theirs["static ctor"], f"rank {rank} _set_static_graph() vs static_graph=True"
        )
        _assert_runs_same(ours["static ctor"], theirs["static ctor"], f"rank {rank} static_graph=True")
        assert ours["mesh group"] and theirs["mesh group"]
        _assert_runs_same(ours["mesh"], theirs["mesh"], f"rank {rank} device_mesh")
        _assert_raised(theirs["group and mesh"], RuntimeError, "process_group and device_mesh", "torch both")
        _assert_raised(ours["group and mesh"], RuntimeError, "process_group and device_mesh", "lockstep both")
    for case in ("static", "mesh"):
        _assert_replicas(out, lambda by_kind, case=case: by_kind["ours"][case]["params"], case)


# ------------------------------------------------------ 10 + 11: hook validation, wrap-time errors


def _hook_bad_bucket(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return _halving_hook(state, bucket)


def _hook_bad_return(state: object, bucket: dist.GradBucket) -> int:
    return _halving_hook(state, bucket)


def _hook_annotated(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _halving_hook(state, bucket)


def _hook_returns_int(state, bucket):
    return 1


def _frozen_mlp() -> nn.Module:
    module = MLP()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def _checks(kind: str) -> dict[str, Any]:
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    module = _seeded(MLP, rank)
    ddp = _ddp(kind, module)
    res["not callable"] = _raised(lambda: ddp.register_comm_hook(state=None, hook=1))
    res["bad bucket"] = _raised(lambda: ddp.register_comm_hook(None, _hook_bad_bucket))
    res["bad return"] = _raised(lambda: ddp.register_comm_hook(None, _hook_bad_return))
    res["valid after failures"] = _raised(lambda: ddp.register_comm_hook(None, _hook_annotated))
    res["train"] = _train(ddp, module, _ce(rank), 2)
    res["second"] = _raised(lambda: ddp.register_comm_hook(None, _halving_hook))
    # a hook that returns no Future: backward raises on every rank
    bad_module = _seeded(MLP, rank)
    bad = _ddp(kind, bad_module)
    res["register returns int"] = _raised(lambda: bad.register_comm_hook(None, _hook_returns_int))
    res["backward returns int"] = _raised(lambda: _ce(rank)(bad, 0).backward())
    dist.barrier()
    # 11. wrap-time errors
    res["frozen"] = _raised(lambda: _ddp(kind, _frozen_mlp()))
    res["no parameters"] = _raised(lambda: _ddp(kind, nn.Sequential(nn.ReLU())))
    res["lazy"] = _raised(lambda: _ddp(kind, nn.Sequential(nn.LazyLinear(4))))
    dist.barrier()
    return res


def _errors() -> dict[str, Any]:
    return {kind: _checks(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def checked() -> list[dict[str, Any]]:
    """One launch for both tests below."""
    return run_distributed(_errors, WORLD, timeout=90)


def test_comm_hook_validation_like_torch(checked: list[dict[str, Any]]) -> None:
    for rank, by_kind in enumerate(checked):
        for kind in KINDS:
            res, what = by_kind[kind], f"rank {rank} {kind}"
            _assert_raised(
                res["not callable"],
                TypeError,
                re.escape("Communication hook must be callable."),
                f"{what} hook=1",
            )
            _assert_raised(
                res["bad bucket"],
                ValueError,
                re.escape("bucket annotation should be dist.GradBucket."),
                f"{what} bucket: int",
            )
            _assert_raised(
                res["bad return"],
                ValueError,
                re.escape("Communication hook: return annotation should be torch.futures.Future"),
                f"{what} -> int",
            )
            assert res["valid after failures"] is None, (
                f"{what}: a valid hook was refused: {res['valid after failures']}"
            )
            _assert_raised(
                res["second"],
                RuntimeError,
                re.escape("register_comm_hook or register_builtin_comm_hook can only be called once."),
                f"{what} second hook",
            )
            assert res["register returns int"] is None, f"{what}: {res['register returns int']}"
            _assert_raised(
                res["backward returns int"],
                RuntimeError,
                "callback must return a torch.futures.Future object, but got",
                f"{what} hook returns 1",
            )
        # the valid hook registered after the failed ones averages like torch's
        _assert_runs_same(
            by_kind["ours"]["train"], by_kind["torch"]["train"], f"rank {rank} hook after failures"
        )
    _assert_replicas(checked, lambda by_kind: by_kind["ours"]["train"]["params"], "hook after failures")


def test_wrap_time_errors_like_torch(checked: list[dict[str, Any]]) -> None:
    cases = [
        ("frozen", "Modules whose parameters are all frozen", "."),
        ("no parameters", "A module without any parameter (nn.ReLU)", "."),
        ("lazy", "nn.LazyLinear", "Modules with uninitialized parameters"),
    ]
    problems = []
    for rank, by_kind in enumerate(checked):
        for kind in KINDS:
            for key, label, pattern in cases:
                try:
                    _assert_raised(by_kind[kind][key], RuntimeError, pattern, f"rank {rank} {kind}: {label}")
                except AssertionError as exc:
                    problems.append(str(exc).splitlines()[0])
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- buffers at wrap time, bf16 parameters


def _buffers_and_half_precision(kind: str) -> dict[str, Any]:
    rank = dist.get_rank()
    bn = nn.BatchNorm1d(4)
    bn.running_mean.fill_(float(rank + 1))
    _ddp(kind, nn.Sequential(nn.Linear(4, 4), bn), broadcast_buffers=False)
    kept = bn.running_mean.clone()  # torch: broadcast_buffers=False leaves each rank's buffers alone
    module = _seeded(MLP, 10 + rank).to(torch.bfloat16)
    model = _ddp(kind, module, bucket_cap_mb=0.001)

    def loss(m: nn.Module, step: int) -> Tensor:
        x, y = batch(rank, step)
        return F.cross_entropy(m(x.to(torch.bfloat16)).float(), y)

    run = _train(model, module, loss, 2)
    run["bucket_dtypes"] = model.stats().extras["bucket_dtypes"] if kind == "ours" else None
    return {"kept": kept, "bf16": run}


def _buffers_and_half_precision_both() -> dict[str, Any]:
    return {kind: _buffers_and_half_precision(kind) for kind in ("ours", "torch")}


def test_unsynced_buffers_at_wrap_and_bf16_parameters_like_torch() -> None:
    out = run_distributed(_buffers_and_half_precision_both, WORLD, timeout=90)
    for rank, rank_out in enumerate(out):
        for kind in ("ours", "torch"):
            assert torch.equal(rank_out[kind]["kept"], torch.full((4,), float(rank + 1))), (kind, rank)
        # torch reduces bf16 gradients in bf16; the drop-in class does the same, bit for bit
        _assert_runs_same(rank_out["ours"]["bf16"], rank_out["torch"]["bf16"], f"bf16 rank {rank}")
        assert all(g.dtype == torch.bfloat16 for g in rank_out["ours"]["bf16"]["grads"][0])
        assert set(rank_out["ours"]["bf16"]["bucket_dtypes"]) == {"bfloat16"}  # not widened to fp32
