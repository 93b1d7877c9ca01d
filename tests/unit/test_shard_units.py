"""engine/optim/shard_units.py: which parameters are cut into pieces, and why that keeps the bits.

A sharded optimizer steps 1-D pieces of a parameter only for the classes of ELEMENTWISE: each must give,
piece by piece, the bits of the whole step (foreach or not, with the options that add state). If a torch
release makes one of them read a parameter as a whole, this fails before any sharded run differs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lockstep.engine.optim.shard_units import ELEMENTWISE, MIN_PIECE_NUMEL, Units, default_piece_numel

OPTIONS: dict[type[torch.optim.Optimizer], dict[str, Any]] = {
    torch.optim.SGD: {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    torch.optim.Adam: {"lr": 1e-2, "amsgrad": True},
    torch.optim.AdamW: {"lr": 1e-2, "weight_decay": 0.1},
    torch.optim.Adamax: {"lr": 1e-2},
    torch.optim.NAdam: {"lr": 1e-2},
    torch.optim.RAdam: {"lr": 1e-2},
    torch.optim.RMSprop: {"lr": 1e-2, "momentum": 0.5, "centered": True},
    torch.optim.Adagrad: {"lr": 0.1},
}


def test_every_elementwise_class_has_options_here() -> None:
    assert set(OPTIONS) == set(ELEMENTWISE)


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("cls", ELEMENTWISE, ids=lambda c: c.__name__)
def test_stepping_the_pieces_gives_the_whole_steps_bits(
    cls: type[torch.optim.Optimizer], foreach: bool
) -> None:
    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(300, 7))
    cut = torch.nn.Parameter(whole.detach().clone())
    units = Units([cut], piece_numel=500)  # 2100 elements: pieces of 500, 500, 500, 500, 100
    assert [u.numel() for u in units.tensors] == [500, 500, 500, 500, 100]
    reference = cls([whole], foreach=foreach, **OPTIONS[cls])
    stepped = cls([cut], foreach=foreach, **OPTIONS[cls])
    every = list(range(len(units.tensors)))
    built = stepped.state.pop(
        cut, None
    )  # Adagrad builds its state at construction: cut it as the sharder does
    stepped.param_groups[0]["params"] = list(units.tensors)
    if built:
        for u, entry in units.split_state(0, built, every).items():
            stepped.state[units.tensors[u]] = entry
    for _ in range(4):
        grad = torch.randn(300, 7)
        whole.grad, cut.grad = grad.clone(), grad.clone()
        units.attach_grads(every)
        reference.step()
        stepped.step()
        units.detach_grads(every)
    assert torch.equal(whole, cut)
    assert all(t.grad is None for t in units.tensors), "a piece kept its gradient view"
    merged = units.merge_state(0, [stepped.state[t] for t in units.tensors])
    expected = reference.state[whole]
    assert list(merged) == list(expected)
    for key, value in expected.items():
        assert torch.equal(torch.as_tensor(merged[key]), torch.as_tensor(value)), key


def test_what_stays_whole() -> None:
    small, big = torch.zeros(10), torch.zeros(40, 50)
    strided = torch.zeros(50, 40).t()  # not contiguous: its storage order is not its element order
    units = Units([small, big, strided], piece_numel=600)
    assert units.of_param == [[0], [1, 2, 3, 4], [5]]
    assert units.tensors[0] is small and units.tensors[5] is strided and units.bounds[5] is None
    assert units.bounds[1:5] == [(0, 600), (600, 1200), (1200, 1800), (1800, 2000)]
    assert all(
        units.tensors[u].untyped_storage().data_ptr() == big.untyped_storage().data_ptr() for u in (1, 4)
    )
    assert Units([big], piece_numel=None).tensors == [big]  # not an elementwise optimizer: whole parameters


def test_the_default_piece_is_a_32nd_of_the_model_and_never_below_a_floor() -> None:
    assert default_piece_numel([torch.empty(10)]) == MIN_PIECE_NUMEL
    big = torch.empty(64 * MIN_PIECE_NUMEL)
    assert default_piece_numel([big]) == 2 * MIN_PIECE_NUMEL


def test_state_is_cut_and_joined_back_per_parameter() -> None:
    p = torch.zeros(4, 5)
    units = Units([p], piece_numel=8)  # pieces of 8, 8, 4
    state = {"step": torch.tensor(3.0), "exp_avg": torch.arange(20.0).view(4, 5), "flag": True}
    pieces = units.split_state(0, state, [0, 1, 2])
    assert [pieces[u]["exp_avg"].tolist() for u in (0, 1, 2)] == [
        list(map(float, range(0, 8))), list(map(float, range(8, 16))), list(map(float, range(16, 20)))
    ]  # fmt: skip
    assert pieces[0]["step"] is not pieces[1]["step"], "each piece must count its own steps"
    joined = units.merge_state(0, [pieces[u] for u in (0, 1, 2)])
    assert torch.equal(joined["exp_avg"], state["exp_avg"]) and joined["exp_avg"].shape == (4, 5)
    assert torch.equal(joined["step"], state["step"]) and joined["flag"] is True


def test_one_table_says_what_is_cut_and_what_overlaps() -> None:
    from lockstep.engine.optim.optimizer_steps import PER_PARAMETER_OPTIMIZERS
    from lockstep.engine.optim.shard_units import ELEMENTWISE_OPTIMIZERS, OVERLAPPED

    assert ELEMENTWISE == tuple(ELEMENTWISE_OPTIMIZERS)
    assert OVERLAPPED == (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
    assert PER_PARAMETER_OPTIMIZERS is OVERLAPPED  # the overlapped step reads the same table


def test_swapped_params_gives_back_the_lists_and_state_even_after_an_error() -> None:
    from lockstep.engine.optim.shard_units import swapped_params

    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
    lists, state, share = [g["params"] for g in opt.param_groups], opt.state, {}
    with pytest.raises(RuntimeError, match="boom"), swapped_params(opt, [[b], []], share):
        assert [g["params"] for g in opt.param_groups] == [[b], []] and opt.state is share
        raise RuntimeError("boom")
    assert all(g["params"] is saved for g, saved in zip(opt.param_groups, lists)) and opt.state is state
