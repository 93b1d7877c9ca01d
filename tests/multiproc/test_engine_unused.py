"""Unused parameters (issue 3 item 6): handled with find_unused_parameters, named without it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lockstep.errors import UnusedParameterError
from lockstep.testing import run_distributed
from lockstep.testing.parity import run_parity, train_replica
from tests.multiproc.engine_util import case

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
