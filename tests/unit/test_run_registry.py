"""trainer/run/registry.py: one set of named entries serves checkpoints, a replacement's transfer and a mark."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lockstep.errors import InternalError
from lockstep.trainer.reporting.metrics import TrainMetrics
from lockstep.trainer.run.registry import EVERY, RECOVERY, StateRegistry, Use
from lockstep.trainer.run.run_state import RunState


class Box:
    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_each_use_gets_its_entries_in_registration_order() -> None:
    reg = StateRegistry()
    a, b, c = Box(1), Box(2), Box(3)
    reg.register("a", a)
    reg.register("b", b, uses=Use.CHECKPOINT)
    reg.register("c", c, uses=Use.MARK)
    assert reg.checkpoint_entries() == {"a": a, "b": b}
    assert reg.snapshot(Use.TRANSFER) == {"a": {"value": 1}}
    assert reg.snapshot(Use.MARK) == {"a": {"value": 1}, "c": {"value": 3}}
    assert reg.keys(RECOVERY) == ["a", "c"]
    tree = reg.snapshot(Use.MARK)
    a.value, c.value = 10, 30
    reg.restore(tree, Use.MARK)
    assert (a.value, c.value) == (1, 3)


def test_a_host_snapshot_is_a_copy_and_restores_again() -> None:
    reg = StateRegistry()
    t = torch.ones(3)
    reg.register_state_dict_fn("t", lambda s: t.copy_(s), lambda: t, uses=RECOVERY)
    mark = reg.snapshot(Use.MARK, host=True)
    t.add_(1)
    assert mark["t"].tolist() == [1.0, 1.0, 1.0]
    reg.restore(mark, Use.MARK, copied=True)
    t.add_(5)
    reg.restore(mark, Use.MARK, copied=True)
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_registration_and_restore_mistakes_are_internal_errors() -> None:
    reg = StateRegistry()
    reg.register("a", Box(1))
    with pytest.raises(InternalError, match="registered twice"):
        reg.register("a", Box(2))
    with pytest.raises(InternalError, match="target"):
        reg.register_state_dict_fn("b", lambda s: None, lambda: 0, uses=EVERY)
    with pytest.raises(InternalError, match="lacks the entries"):
        reg.restore({}, Use.TRANSFER)
    with pytest.raises(InternalError, match="checkpoint_entries"):
        reg.snapshot(Use.CHECKPOINT)
    reg.register_state_dict_fn("c", lambda s: None, lambda: 0, uses=Use.TRANSFER, required=False)
    reg.restore({"a": {"value": 5}}, Use.TRANSFER)  # an entry not required may be absent


def _run_state() -> RunState:
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return RunState(module, optimizer, scheduler, scaler, Box(0), TrainMetrics("regression", ordered=False))


def test_fit_run_state_keeps_the_checkpoint_keys_of_older_checkpoints() -> None:
    state = _run_state()
    assert list(state.registry.checkpoint_entries()) == [
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "sampler",
        "progress",
        "goodput",  # newer than older checkpoints: fit loads it as optional (run_records.py)
    ]
    assert list(state.registry.snapshot(Use.TRANSFER)) == [
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "sampler",
        "progress",
        "record",
        "faults",
        "metrics",
        "goodput",
    ]


def test_a_mark_puts_the_run_back_but_keeps_its_faults() -> None:
    state = _run_state()
    state.counters.step, state.record.saved_step = 4, 4
    mark = state.registry.snapshot(Use.MARK, host=True)
    before = state.module.weight.detach().clone()
    random_before = torch.rand(2)
    state.registry.restore(mark, Use.MARK, copied=True)  # the generators back where the mark was
    assert torch.equal(torch.rand(2), random_before)
    with torch.no_grad():
        state.module.weight.add_(1)
    state.counters.step, state.record.saved_step = 7, 7
    state.record.faults.append({"kind": "lost"})
    state.registry.restore(mark, Use.MARK, copied=True)
    assert torch.equal(state.module.weight, before)
    assert (state.counters.step, state.record.saved_step) == (4, 4)
    assert state.record.faults == [{"kind": "lost"}]
