"""runtime/state_transfer: a training state taken apart into JSON and tensors, and put back, without pickle."""

from __future__ import annotations

import pytest
import torch

from lockstep.errors import ConfigError, InternalError
from lockstep.runtime.state_transfer import _metas, join, split


def _optimizer_state() -> dict[str, object]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return opt.state_dict()


def test_a_state_comes_back_with_its_types_int_keys_and_bits() -> None:
    tree = {
        "optimizer": _optimizer_state(),  # state keyed by int parameter index, step tensors, param_groups
        "nested": {"tuple": (1, 2.5, "x", None, True), "list": [float("inf"), -0.0]},
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "flags": torch.tensor([True, False]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    skeleton, tensors = split(tree)
    back = join(skeleton, tensors)
    assert set(back["optimizer"]["state"]) == {0, 1}  # int keys, not "0"/"1"
    assert back["nested"]["tuple"] == (1, 2.5, "x", None, True)
    assert back["nested"]["list"][0] == float("inf")
    assert torch.equal(back["half"], tree["half"]) and back["half"].dtype == torch.bfloat16
    assert [dtype for dtype, _ in _metas(skeleton)] == [t.dtype for t in tensors]
    assert [shape for _, shape in _metas(skeleton)] == [list(t.shape) for t in tensors]


def test_an_object_that_would_need_pickle_is_refused_with_its_place() -> None:
    with pytest.raises(ConfigError, match=r"state\['sched'\]\['fn'\] holds a function"):
        split({"sched": {"fn": lambda step: step}})


def test_a_skeleton_from_a_peer_cannot_name_anything_but_a_dtype() -> None:
    with pytest.raises(InternalError, match="not a torch dtype"):
        _metas({"t": 0, "dtype": "load", "shape": [1]})
