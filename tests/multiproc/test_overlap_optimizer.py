"""The optimizer overlapped with communication, on real gloo ranks: the plain step's bits, really during
backward, every fallback with its reason said once, misuse raised, and fit with overlap_optimizer=True.

Each rank trains two replicas of the same model on the same data in one process, one stepped plainly
after backward and one through `handle.overlap_optimizer`, and compares parameters and optimizer state
bit for bit. The overlapped model's backward waits between its last and middle layers until the first
buckets' all-reduces are back (an event, tests.helpers.WaitInBackward, not a sleep that a loaded machine
can outlast): the engine must step them at its next launch, while backward goes on (a probe further down
the backward sees the last layer's weight already changed).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import lockstep
import lockstep.hooks
from lockstep.engine.optim.overlapped_optimizer import OverlappedOptimizer
from lockstep.engine.replicate import overlap_optimizer
from lockstep.testing import run_distributed
from lockstep.trainer.settings.config import FitConfig
from tests.helpers import ReductionsStarted, WaitInBackward, small_batch, warmup_decay

TINY_BUCKETS = {"bucket_cap_mb": 1e-4, "first_bucket_mb": 1e-4}  # about one parameter per bucket
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
}


class _Probe(torch.autograd.Function):
    """Identity whose backward notes whether `net.out.weight` changed since the forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, net: _Net) -> torch.Tensor:
        ctx.net, ctx.before = net, net.out.weight.detach().clone()
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.net.changed_in_backward.append(not torch.equal(ctx.net.out.weight, ctx.before))
        return grad, None


class _Net(nn.Module):
    """inp -> mid -> out; `spare` only where `use_spare` (per rank: find_unused_parameters)."""

    def __init__(self, *, watch: ReductionsStarted | None = None, spare: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Registered in this order, the buckets launch as out, spare, mid, inp: on a rank that leaves
        # `spare` unused, its bucket (not the last) waits for finalize while out's steps in backward.
        self.inp, self.mid = nn.Linear(8, 16), nn.Linear(16, 16)
        self.spare = nn.Linear(16, 16) if spare else None
        self.out = nn.Linear(16, 3)
        self.use_spare = False
        self.watch = watch  # its backward waits for the reductions started before (None: it does not)
        self.changed_in_backward: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Probe.apply(torch.tanh(self.inp(x)), self)
        h = torch.tanh(self.mid(h))
        if self.spare is not None and self.use_spare:
            h = h + self.spare(h)
        return self.out(WaitInBackward.apply(h, self.watch))


def _snapshot(net: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
        "state": optimizer.state_dict(),
    }


def _assert_same_bits(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{what}: parameter {name} differs"
    sa, sb = a["state"]["state"], b["state"]["state"]
    assert list(sa) == list(sb), f"{what}: optimizer state entries differ: {list(sa)} != {list(sb)}"
    for index in sa:
        assert sa[index].keys() == sb[index].keys(), what
        for key in sa[index]:
            x, y = torch.as_tensor(sa[index][key]), torch.as_tensor(sb[index][key])
            assert torch.equal(x, y), f"{what}: optimizer state {index}.{key} differs"
    assert a["state"]["param_groups"] == b["state"]["param_groups"], f"{what}: param_groups differ"


def _overlap_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "overlap_optimizer" in str(w.message)]


# ---------------------------------------------------------------- the plain step's bits, during backward


def _train_both(name: str, unused: bool, steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    policy = lockstep.SyncPolicy(find_unused_parameters=unused, **TINY_BUCKETS)
    watch = ReductionsStarted()
    plain_net, net = _Net(spare=unused), _Net(watch=watch, spare=unused)
    lockstep.replicate(plain_net, policy=policy)
    handle = lockstep.replicate(net, policy=policy)
    plain = OPTIMIZERS[name](plain_net.parameters())
    inner = OPTIMIZERS[name](net.parameters())
    plain_schedule = torch.optim.lr_scheduler.LambdaLR(plain, warmup_decay)
    with warnings.catch_warnings(record=True) as caught, watch:
        warnings.simplefilter("always")
        overlapped = handle.overlap_optimizer(inner)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            overlapped, warmup_decay
        )  # on the wrapper: the same groups
        for step in range(steps):
            x, y = small_batch(rank, step)
            # `spare`: used by rank 1 only in even steps (reduced with rank 0's zeros), by no rank in odd
            # ones (its .grad stays as it is, None after zero_grad: the optimizer skips it)
            plain_net.use_spare = net.use_spare = unused and rank == 1 and step % 2 == 0
            for model, opt, sched in ((plain_net, plain, plain_schedule), (net, overlapped, schedule)):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                sched.step()
    return {
        "plain": _snapshot(plain_net, plain),
        "overlapped": _snapshot(net, inner),
        "in_backward": overlapped.buckets_stepped_in_backward,
        "at_finalize": overlapped.buckets_stepped_at_finalize,
        "num_buckets": handle.stats().num_buckets,
        "extras": handle.stats().extras,
        "changed_in_backward": net.changed_in_backward,
        "warnings": _overlap_warnings(caught),
        "reasons": overlapped.fallback_reasons,
    }


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("unused", [False, True], ids=["all_used", "find_unused"])
def test_the_overlapped_step_is_bitwise_the_plain_step(name: str, unused: bool) -> None:
    steps = 4
    results = run_distributed(_train_both, 2, args=(name, unused, steps), timeout=120)
    for rank, out in enumerate(results):
        what = f"{name} rank {rank}"
        _assert_same_bits(out["plain"], out["overlapped"], what)
        assert out["warnings"] == [] and out["reasons"] == [], what
        assert out["num_buckets"] >= 3, what
        # every bucket of every step stepped in the engine, during backward or in finalize
        assert out["in_backward"] + out["at_finalize"] == steps * out["num_buckets"], (what, out)
        assert out["extras"]["optimizer_buckets_stepped_in_backward"] == out["in_backward"], what
        assert out["extras"]["optimizer_buckets_stepped_at_finalize"] == out["at_finalize"], what
    _assert_same_bits(results[0]["overlapped"], results[1]["overlapped"], f"{name}: the ranks")
    # backward waits until the last layer's buckets are back: they step at the next launch, in backward
    stepped_early = [out["in_backward"] for out in results]
    assert min(stepped_early) >= 1, f"{name}: no bucket stepped during backward: {stepped_early}"
    assert any(any(out["changed_in_backward"]) for out in results), name


# ---------------------------------------------------------------- the same bits under the engine's options

ENGINE_OPTIONS = ("dropin", "fp16_hook", "gradient_as_bucket_view", "join", "powersgd", "static_graph")


def _train_with(option: str, overlap: bool, steps: int) -> dict[str, Any]:
    """One run of `steps` steps (rank 1 has two more in "join") with the engine set up as `option` says."""
    rank = dist.get_rank()
    watch = ReductionsStarted(expected=False)  # the drop-in class may launch nothing before it at first
    net = _Net(watch=watch if overlap else None)
    model: nn.Module = net
    face: Any
    if option == "dropin":  # the drop-in class, overlapped through the engine as fit does it
        face = model = lockstep.DistributedDataParallel(net, bucket_cap_mb=1e-4)
    else:
        extra = {option: True} if option in ("gradient_as_bucket_view", "static_graph") else {}
        face = lockstep.replicate(net, policy=lockstep.SyncPolicy(**TINY_BUCKETS, **extra))
    if option == "fp16_hook":
        face.register_comm_hook(lockstep.hooks.HookState(None), lockstep.hooks.fp16_compress_hook)
    if option == "powersgd":
        state = lockstep.hooks.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        face.register_comm_hook(state, lockstep.hooks.powerSGD_hook)
    inner = OPTIMIZERS["adamw"](net.parameters())
    optimizer = overlap_optimizer(face, inner, clip_grad_norm=False, scaler=None) if overlap else inner
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)
    with face.join() if option == "join" else contextlib.nullcontext(), watch:
        for step in range(steps + (2 * rank if option == "join" else 0)):
            x, y = small_batch(rank, step)
            optimizer.zero_grad(set_to_none=option != "gradient_as_bucket_view")
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            schedule.step()
    stepped = (
        optimizer.buckets_stepped_in_backward + optimizer.buckets_stepped_at_finalize
        if isinstance(optimizer, OverlappedOptimizer)
        else 0
    )
    return {"bits": _snapshot(net, inner), "stepped": stepped}


def _train_with_and_without(option: str, steps: int) -> dict[str, Any]:
    return {overlap: _train_with(option, overlap, steps) for overlap in (False, True)}


@pytest.mark.parametrize("option", ENGINE_OPTIONS)
def test_the_overlapped_step_keeps_the_bits_under_the_engines_options(option: str) -> None:
    results = run_distributed(_train_with_and_without, 2, args=(option, 4), timeout=120)
    for rank, out in enumerate(results):
        _assert_same_bits(out[False]["bits"], out[True]["bits"], f"{option} rank {rank}")
        assert out[True]["stepped"] > 0, f"{option} rank {rank}: the engine stepped no bucket"
    if option != "join":  # under join() rank 1 takes more optimizer steps; the parameters agree anyway
        _assert_same_bits(results[0][True]["bits"], results[1][True]["bits"], f"{option}: the ranks")
    for name, value in results[0][True]["bits"]["params"].items():
        assert torch.equal(value, results[1][True]["bits"]["params"][name]), f"{option}: {name} differs"


# ---------------------------------------------------------------- fallbacks: the plain step, and why, once

FALLBACKS = {
    "clip": "gradient clipping by global norm needs every gradient before any parameter steps",
    "scaler": "the fp16 GradScaler's inf check needs every gradient before any parameter steps",
    "unknown": "lockstep does not know that torch.optim.rmsprop.RMSprop steps each parameter",
    "accumulate": "accumulate() scales the averaged gradients into the mean",
    "deterministic": "SyncPolicy(deterministic=True) sums the gradients exactly",
}


def _fallback(kind: str, steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    if kind == "deterministic":
        policy = lockstep.SyncPolicy(deterministic=True)
    else:
        policy = lockstep.SyncPolicy(**TINY_BUCKETS)
    plain_net, net = _Net(), _Net()
    plain_handle, handle = (
        lockstep.replicate(plain_net, policy=policy),
        lockstep.replicate(net, policy=policy),
    )
    make = OPTIMIZERS["sgd_momentum"] if kind != "unknown" else (lambda p: torch.optim.RMSprop(p, lr=1e-2))
    plain, inner = make(plain_net.parameters()), make(net.parameters())
    scalers = [torch.amp.GradScaler("cpu", init_scale=64.0, enabled=kind == "scaler") for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overlapped = handle.overlap_optimizer(
            inner, clip_grad_norm=kind == "clip", scaler=scalers[1] if kind == "scaler" else None
        )
        runs = ((plain_handle, plain_net, plain, scalers[0]), (handle, net, overlapped, scalers[1]))
        for step in range(steps):
            for each_handle, model, opt, scaler in runs:
                opt.zero_grad(set_to_none=True)
                _backward(kind, each_handle, model, scaler, rank, step)
                if kind == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                scaler.step(opt)
                scaler.update()
    return {
        "plain": _snapshot(plain_net, plain),
        "overlapped": _snapshot(net, inner),
        "stepped": overlapped.buckets_stepped_in_backward + overlapped.buckets_stepped_at_finalize,
        "warnings": _overlap_warnings(caught),
        "reasons": overlapped.fallback_reasons,
    }


def _backward(
    kind: str,
    handle: lockstep.ReplicaHandle,
    model: nn.Module,
    scaler: torch.amp.GradScaler,
    rank: int,
    step: int,
) -> None:
    """One synced backward: a plain one, or a step of 4 micro-batches through accumulate()."""
    if kind not in ("accumulate", "deterministic"):
        x, y = small_batch(rank, step)
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        return
    handle.accumulate(
        lambda b: F.cross_entropy(model(b[0]), b[1]).backward(),
        {k: small_batch(k, step) for k in handle.owned_micro_batches(4)},
        num_micro_batches=4,
        step=step,
    )


@pytest.mark.parametrize("kind", sorted(FALLBACKS))
def test_a_step_that_needs_every_gradient_falls_back_and_says_why_once(kind: str) -> None:
    for rank, out in enumerate(run_distributed(_fallback, 2, args=(kind, 3), timeout=120)):
        what = f"{kind} rank {rank}"
        _assert_same_bits(out["plain"], out["overlapped"], what)
        assert out["stepped"] == 0, f"{what}: the engine stepped {out['stepped']} buckets"
        assert len(out["reasons"]) == 1 and out["reasons"][0].startswith(FALLBACKS[kind]), (what, out)
        assert len(out["warnings"]) == 1, f"{what}: said {len(out['warnings'])} times: {out['warnings']}"
        said = out["warnings"][0]
        assert said.startswith(f"[rank {rank}/2] overlap_optimizer: ") and FALLBACKS[kind] in said, said


# ---------------------------------------------------------------- what would silently differ raises


def _misuse(kind: str) -> str:
    rank = dist.get_rank()
    net = _Net(spare=kind == "unused_without_flag")  # spare, never used, without find_unused_parameters
    handle = lockstep.replicate(net, policy=lockstep.SyncPolicy(**TINY_BUCKETS))
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    overlapped = handle.overlap_optimizer(inner)
    x, y = small_batch(rank, 0)
    try:
        F.cross_entropy(net(x), y).backward()  # the engine steps every bucket by the end of it
    except lockstep.errors.UnusedParameterError:  # on every rank, after out's bucket stepped in finalize
        pass
    try:
        if kind == "unused_without_flag":
            overlapped.step()
        elif kind == "undeclared_clip":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            overlapped.step()
        elif kind == "second_backward":
            F.cross_entropy(net(x), y).backward()
        elif kind == "inner_step":
            inner.step()
        else:
            handle.overlap_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    except lockstep.errors.UsageError as exc:
        return str(exc)
    return "nothing raised"


MISUSES = {
    "undeclared_clip": "changed between backward() and optimizer.step(), after the engine had already stepped",
    "second_backward": "a synced backward began before optimizer.step() finished the previous one",
    "inner_step": "AdamW.step() was called on the optimizer given to overlap_optimizer",
    "twice": "overlap_optimizer was already called on this replica",
    "unused_without_flag": "the previous backward raised after the engine had stepped some buckets' parameters",
}


@pytest.mark.parametrize("kind", sorted(MISUSES))
def test_what_would_silently_differ_raises_usage_error(kind: str) -> None:
    for rank, said in enumerate(run_distributed(_misuse, 2, args=(kind,), timeout=60)):
        assert said.startswith(f"[rank {rank}/2] ") and MISUSES[kind] in said, f"rank {rank}: {said}"


# ---------------------------------------------------------------- fit


def _fit_both(run_dir: str, name: str, clip: bool, deterministic: bool, fp16: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=gen)
    data = TensorDataset(x, torch.randint(0, 3, (64,), generator=gen))
    out: dict[str, Any] = {}
    for overlap in (False, True):
        net = _Net()
        made: list[torch.optim.Optimizer] = []
        in_backward: list[bool] = []
        # 8 samples a micro-batch, 2 per rank and step (no_sync, then the synced backward); deterministic
        # mode cuts the same global batch of 32 into micro-batches over the ranks (accumulate())
        batches = (
            {"global_batch_size": 32, "micro_batch_size": 8} if deterministic else {"grad_accum_steps": 2}
        )
        config = FitConfig(
            run_dir=f"{run_dir}/{name}-{clip}-{deterministic}-{overlap}",
            batch_size=8,
            epochs=2,
            lr_schedule="cosine",
            warmup_steps=2,
            clip_grad_norm=0.05 if clip else None,
            deterministic=deterministic,
            precision="fp16" if fp16 else "fp32",
            progress="none",
            overlap_optimizer=overlap,
            **batches,  # type: ignore[arg-type]
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lockstep.fit(
                net,
                data,
                loss_fn=F.cross_entropy,
                config=config,
                optimizer=_making(name, made, in_backward),
            )
        out[f"overlap={overlap}"] = _snapshot(net, made[0])
        out[f"warnings overlap={overlap}"] = _overlap_warnings(caught)
        out[f"steps in backward overlap={overlap}"] = sum(in_backward)
    return out


def _making(name: str, made: list[torch.optim.Optimizer], in_backward: list[bool]) -> Any:
    """fit's optimizer factory: `name`'s optimizer, kept in `made`; each of its steps notes in
    `in_backward` whether the autograd engine was running (the engine's steps during a backward)."""

    def make(params: Any) -> torch.optim.Optimizer:
        optimizer = OPTIMIZERS[name](params)
        optimizer.register_step_pre_hook(
            lambda *_: in_backward.append(torch._C._current_graph_task_id() != -1)
        )
        made.append(optimizer)
        return optimizer

    return make


FIT_CASES = {
    "sgd_momentum": ("sgd_momentum", False, False, None),
    "adamw": ("adamw", False, False, None),
    "clip": ("adamw", True, False, "gradient clipping by global norm needs every gradient"),
    "deterministic": ("sgd_momentum", False, True, "fit's steps in deterministic and live mode run through"),
    "fp16": ("adamw", False, False, "the fp16 GradScaler's inf check needs every gradient"),
}


@pytest.mark.parametrize("case", sorted(FIT_CASES))
def test_fit_with_overlap_optimizer_gives_the_same_bits(case: str, tmp_path: Any) -> None:
    name, clip, deterministic, reason = FIT_CASES[case]
    args = (str(tmp_path), name, clip, deterministic, case == "fp16")
    results = run_distributed(_fit_both, 2, args=args, timeout=180)
    for rank, out in enumerate(results):
        _assert_same_bits(out["overlap=False"], out["overlap=True"], f"fit {case} rank {rank}")
        assert out["warnings overlap=False"] == [], out["warnings overlap=False"]
        assert out["steps in backward overlap=False"] == 0
        said, early = out["warnings overlap=True"], out["steps in backward overlap=True"]
        if reason is None:  # overlapped: the engine stepped the buckets inside the backward
            assert said == [] and early > 0, f"fit {case} rank {rank}: {said}, {early} steps in backward"
        else:
            assert len(said) == 1 and reason in said[0], f"fit {case} rank {rank}: {said}"
            assert early == 0, f"fit {case} rank {rank}: fell back, yet {early} steps in backward"
