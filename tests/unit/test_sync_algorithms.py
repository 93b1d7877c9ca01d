"""The periodic sync algorithms behind one interface, and `sync` read in one place.

parse_sync maps each name to its class (None for "allreduce") and refuses any other value with a
ConfigError naming the choices; SyncPolicy and OuterSync ask it; each class's flags and math on one
process (world 1: the mean of one replica is itself). And a structure check: no module of src/lockstep
but the parser's compares a sync name (a literal, or the parser's tables) in `==`, `!=`, `in` or `case`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import lockstep
from lockstep import plan
from lockstep.engine.core import policy as policy_module
from lockstep.engine.core.sync_algorithms import (
    ALGORITHMS,
    EVERY_STEP,
    MIX,
    SYNC_MODES,
    DiLoCo,
    LocalSGD,
    StreamingDiLoCo,
    SyncAlgorithm,
    is_periodic,
    parse_sync,
)
from lockstep.engine.periodic.outer_sync import OuterSync
from lockstep.errors import ConfigError

SRC = Path(lockstep.__file__).resolve().parent
PARSER = SRC / "engine" / "core" / "sync_algorithms.py"
NAMES = {"allreduce", "local_sgd", "diloco", "streaming_diloco"}
TABLES = {"SYNC_MODES", "ALGORITHMS", "EVERY_STEP"}  # the parser's own: comparing against them is parsing too


def test_the_parser_maps_each_name_to_its_class() -> None:
    assert parse_sync("allreduce") is None
    assert parse_sync("local_sgd") is LocalSGD
    assert parse_sync("diloco") is DiLoCo
    assert parse_sync("streaming_diloco") is StreamingDiLoCo
    assert SYNC_MODES == (
        "allreduce",
        "local_sgd",
        "diloco",
        "streaming_diloco",
    )  # FitConfig's choices, in order
    assert policy_module.SYNC_MODES is SYNC_MODES is plan.SYNC_MODES  # one tuple of names, the launcher's too
    assert (EVERY_STEP, *ALGORITHMS) == SYNC_MODES  # the classes' names are the plan's
    assert all(cls.name == name and issubclass(cls, SyncAlgorithm) for name, cls in ALGORITHMS.items())
    assert [is_periodic(name) for name in SYNC_MODES] == [False, True, True, True]


@pytest.mark.parametrize("bad", ["gossip", "DiLoCo", "", None, 3, ["diloco"]])
def test_a_bad_name_raises_a_config_error_naming_the_choices(bad: object) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_sync(bad)
    message = str(raised.value)
    assert all(name in message for name in SYNC_MODES), message
    assert repr(bad) in message
    with pytest.raises(ConfigError, match="SyncPolicy.sync must be one of allreduce, local_sgd"):
        lockstep.SyncPolicy(sync=bad)  # type: ignore[arg-type]


def test_the_policy_asks_the_parser() -> None:
    assert lockstep.SyncPolicy().algorithm is None and not lockstep.SyncPolicy().periodic
    for name, cls in ALGORITHMS.items():
        policy = lockstep.SyncPolicy(sync=name)
        assert policy.algorithm is cls and policy.periodic
    lockstep.SyncPolicy(sync="streaming_diloco", fragments=2)  # fragmented: the only one with fragments
    for name in ("local_sgd", "diloco"):
        with pytest.raises(
            ConfigError, match=rf"^fragments=2 does not apply with sync='{name}': only streaming"
        ):
            lockstep.SyncPolicy(sync=name, fragments=2)


def test_the_flags_of_each_class() -> None:
    assert [(c.fragmented, c.delayed) for c in (LocalSGD, DiLoCo, StreamingDiLoCo)] == [
        (False, False),
        (False, False),
        (True, True),
    ]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _drift(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def test_outer_sync_holds_the_algorithm_chosen_once_and_its_fragments() -> None:
    for name, cls in ALGORITHMS.items():
        fragments = 3 if cls.fragmented else 1
        policy = lockstep.SyncPolicy(sync=name, sync_every=2, fragments=fragments)
        outer = OuterSync(_model(), policy, None, world=1)
        assert type(outer.algorithm) is cls
        assert len(outer.fragments) == len(outer.pieces) == fragments
        anchored = cls is not LocalSGD
        parts = sum(len(f) for f in outer.fragments)  # sliced (the default): rows of each parameter
        assert len(outer.anchor) == (parts if anchored else 0) and len(outer.outer) == (
            fragments if anchored else 0
        )
        if anchored:  # every parameter's values anchored once
            assert sum(a.numel() for a in outer.anchor) == sum(p.numel() for p in _model().parameters())
        assert all(a.dtype == torch.float32 for a in outer.anchor)
        assert outer.state_dict()["sync"] == name
    with pytest.raises(ConfigError, match="resume with the same settings"):
        diloco = OuterSync(_model(), lockstep.SyncPolicy(sync="diloco"), None, world=1)
        diloco.load_state_dict(
            OuterSync(_model(), lockstep.SyncPolicy(sync="local_sgd"), None, world=1).state_dict()
        )


def test_each_algorithm_on_one_replica() -> None:
    """World 1: the mean is the replica's own contribution, so each class's apply() shows plainly."""
    start = [p.detach().clone() for p in _model().parameters()]

    # local SGD: the average of one replica is itself
    model = _model()
    outer = OuterSync(model, lockstep.SyncPolicy(sync="local_sgd", sync_every=1), None, world=1)
    _drift(model)
    assert outer.after_optimizer_step()
    assert all(torch.equal(p, s + 1) for p, s in zip(model.parameters(), start))

    # DiLoCo, outer_lr 0.5 and no momentum: the anchor takes an SGD step on the outer gradient, the replica
    # takes the anchor
    stepped = [s.add(s - (s + 1), alpha=-0.5) for s in start]
    model = _model()
    policy = lockstep.SyncPolicy(sync="diloco", sync_every=1, outer_lr=0.5, outer_momentum=0.0)
    outer = OuterSync(model, policy, None, world=1)
    _drift(model)
    assert outer.after_optimizer_step()
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), stepped))
    assert all(torch.equal(a, p) for a, p in zip(outer.anchor, model.parameters()))

    # streaming: launched after the step, merged after the next one (here: flushed) with the local values
    model = _model()
    policy = lockstep.SyncPolicy(sync="streaming_diloco", sync_every=1, outer_lr=0.5, outer_momentum=0.0)
    outer = OuterSync(model, policy, None, world=1)
    _drift(model)
    assert outer.after_optimizer_step() and len(outer.pending) == 1
    assert all(torch.equal(p, s + 1) for p, s in zip(model.parameters(), start))  # not applied yet
    assert outer.flush() and outer.pending == [] and not outer.flush()
    expected = [(s + 1).mul(MIX).add(e, alpha=1 - MIX) for s, e in zip(start, stepped)]
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))


# ---------------------------------------------------------------- `sync` compared in the parser only


def _sync_comparisons(source: str) -> list[int]:
    """The lines where `source` compares a sync name: a literal of NAMES or one of the parser's TABLES as
    an operand of ==, !=, in, not in (alone or inside a tuple, list or set), or as a `case` pattern."""

    def names_a_sync(node: ast.AST) -> bool:
        return any(
            (isinstance(n, ast.Constant) and n.value in NAMES)
            or (isinstance(n, ast.Name) and n.id in TABLES)
            or (isinstance(n, ast.Attribute) and n.attr in TABLES)
            for n in ast.walk(node)
        )

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(names_a_sync(o) for o in operands if not isinstance(o, ast.JoinedStr)):
                found.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and names_a_sync(node.value):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_but_the_parser_compares_a_sync_name() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path == PARSER:
            continue
        for line in _sync_comparisons(path.read_text()):
            offenders.append(f"{path.relative_to(SRC.parent)}:{line}")
    assert not offenders, (
        "`sync` is read in engine/core/sync_algorithms.py only (parse_sync, is_periodic, SyncPolicy.algorithm "
        "and the class's flags); these compare a sync name:\n" + "\n".join(offenders)
    )
    assert _sync_comparisons(PARSER.read_text()), "the parser itself compares: the checker must see it"


def test_the_checker_sees_each_form_and_lets_text_be() -> None:
    source = '''
"""A docstring may say "diloco" and "allreduce"."""
a = sync == "allreduce"
b = config.sync != "streaming_diloco"
c = sync in ("local_sgd", "diloco")
d = sync not in SYNC_MODES
e = "diloco" == sync
match sync:
    case "local_sgd":
        pass
f = f"sync={sync!r}, e.g. 'diloco'"
g = {"diloco": 1}
h = sync == other.sync
i = x in policy_module.ALGORITHMS
'''
    assert _sync_comparisons(source) == [3, 4, 5, 6, 7, 9, 14]
