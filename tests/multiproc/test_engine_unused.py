"""Unused parameters (issue 3 item 6): handled with find_unused_parameters, named without it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lockstep.errors import UnusedParameterError
from lockstep.testing import run_distributed
from lockstep.testing.parity import run_parity, train_replica
from tests.helpers import case

STEPS = 3


def _extra_only_on_rank0(module: torch.nn.Module, rank: int) -> None:
    module.use_extra = rank == 0  # type: ignore[assignment]


@pytest.mark.parametrize("rank_dependent", [False, True])
def test_find_unused_parameters_matches_torch(rank_dependent: bool) -> None:
    # rank-dependent use of `extra` has no single-process equivalent: torch's DDP is the oracle there
    kw = {"find_unused_parameters": True}
    unused = case(
        "unused",
        STEPS,
        ddp_kwargs=kw,
        configure=_extra_only_on_rank0 if rank_dependent else None,
        single_process=not rank_dependent,
    )
    out = run_parity({"unused": unused}, 2)["unused"]
    for by_kind in out:
        # `spare` is unused everywhere: its grad stays None exactly as with torch (checked by run_parity)
        for kind in ("ours", "replicate"):
            spare_grad = by_kind[kind].grads[0][4]  # spare.weight
            assert spare_grad is None
            extra_grad = by_kind[kind].grads[0][
                2
            ]  # extra.weight: used on rank 0 only in the rank-dependent case
            assert extra_grad is not None and extra_grad.abs().sum() > 0


def _no_flag(kind: str, only_rank1_skips: bool) -> str:
    def configure(module: torch.nn.Module, rank: int) -> None:
        module.use_extra = not (only_rank1_skips and rank == 1)  # type: ignore[assignment]
        if only_rank1_skips:
            del module.spare  # every rank uses everything else

    try:
        train_replica(kind, case("unused", 1, configure=configure))
    except UnusedParameterError as exc:
        dist.barrier()  # every rank got here: nobody hangs
        return str(exc)
    return "no error"


@pytest.mark.parametrize("kind", ["ours", "replicate"])
def test_unused_parameter_without_flag_is_named_on_every_rank(kind: str) -> None:
    out = run_distributed(_no_flag, 2, args=(kind, False), timeout=60)
    for rank, message in enumerate(out):
        assert message.startswith(f"[rank {rank}/2]"), message
        assert "'spare.weight'" in message and "'spare.bias'" in message, message
        assert "find_unused_parameters=True" in message, message


def test_a_parameter_unused_on_one_rank_only_raises_everywhere_instead_of_hanging() -> None:
    out = run_distributed(_no_flag, 2, args=("ours", True), timeout=60)
    for message in out:
        assert "rank 1: 'extra.weight', 'extra.bias'" in message, message
        assert "rank 0:" not in message, message


def test_a_parameter_unused_on_one_rank_of_three_raises_everywhere() -> None:
    # torch's bucket layout (the drop-in class) carries the flag as a NaN in its last bucket: world 3
    # checks that every rank reads the same reduced flag and that the ranks without missing gradients
    # join the count that confirms it.
    out = run_distributed(_no_flag, 3, args=("ours", True), timeout=60)
    for rank, message in enumerate(out):
        assert message.startswith(f"[rank {rank}/3]"), message
        assert "rank 1: 'extra.weight', 'extra.bias'" in message, message
        assert "rank 0:" not in message and "rank 2:" not in message, message


def _nan_gradients(kind: str) -> list[list[torch.Tensor]]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if kind == "ours":
        import lockstep

        model: torch.nn.Module = lockstep.DistributedDataParallel(module)
    else:
        model = torch.nn.parallel.DistributedDataParallel(module)
    grads = []
    for step in range(4):  # the bucket rebuild after step 0 is crossed too
        model.zero_grad(set_to_none=True)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        out = model(x).square().mean()
        if step == 1 and rank == 0:  # a real NaN gradient (fp16 overflow, a bad sample): not a flag
            out = out * float("nan")
        out.backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    return grads


def _nan_gradients_both() -> bool:
    ours, theirs = _nan_gradients("ours"), _nan_gradients("torch")
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for ga, gb in zip(a, b):
            torch.testing.assert_close(ga, gb, rtol=0, atol=0, equal_nan=True, msg=f"step {step}")
    assert all(g.isnan().all() for g in ours[1]) and not any(g.isnan().any() for g in ours[2])
    return True


def test_a_real_nan_gradient_is_not_taken_for_a_missing_one() -> None:
    assert run_distributed(_nan_gradients_both, 2, timeout=60) == [True, True]
