"""The tier rule's reader (tests/tiers.py): the world sizes a test starts, as tests/conftest.py reads them
to mark every test on 3 or more ranks `slow`. The functions below are only read, never called."""

from __future__ import annotations

from typing import Any

import pytest

from tests.tiers import MANY_RANKS, ranks_started

WORLD = 3


def run_distributed(fn: Any, world_size: int = 2, **kwargs: Any) -> list[Any]:
    raise AssertionError("only read")


def run_parity(cases: Any, world: int, **kwargs: Any) -> Any:
    raise AssertionError("only read")


def run_cli(*args: str, **kwargs: Any) -> Any:
    raise AssertionError("only read")


def _literal() -> None:
    run_distributed(print, 2)
    run_distributed(print, world_size=4)


def _constant_and_parameter(world: int) -> None:
    run_distributed(print, WORLD)
    run_parity({}, world)


def _loop() -> None:
    results = {w: run_distributed(print, w) for w in (1, 2)}
    for world in range(5, 7):
        run_distributed(print, world, args=(results,))


def _legs(legs: list[tuple[int, bool, int | None]]) -> None:
    for world, _sharded, _steps in legs:
        run_distributed(print, world)


def _calls_helpers(steps: int) -> None:
    _legs([(2, False, 3), (4, True, steps // 2)])  # a hole (steps // 2) does not hide the world size


def _command_line() -> None:
    run_cli("run", "-n", "4", "--run-dir", "out", "script.py", "--lr", "3", "-n", "9")  # 9: the script's
    cmd = ["train", "toy", "--nproc-per-node", str(WORLD)]
    run_cli(*cmd)


def _computed(sizes: list[int]) -> None:
    run_distributed(print, len(sizes) + 1)  # not told by the source: not counted


def _fixture(request: Any) -> Any:
    return run_distributed(print, request.param)


def test_literals_keywords_and_module_constants() -> None:
    assert ranks_started(_literal) == {2, 4}
    assert ranks_started(_constant_and_parameter, params={"world": 5}) == {WORLD, 5}


def test_loops_and_comprehensions_over_literals() -> None:
    assert ranks_started(_loop) == {1, 2, 5, 6}


def test_helpers_are_read_with_their_arguments_bound() -> None:
    assert ranks_started(_calls_helpers) == {2, 4}


def test_command_lines_count_the_first_rank_flag_only() -> None:
    assert ranks_started(_command_line) == {4, 3}
    assert ranks_started(_command_line, command_lines=False) == set()  # tests/unit: parsed, not run


def test_a_parametrized_fixture_is_read_with_the_items_parameter() -> None:
    assert ranks_started(_computed, fixtures={"runs": _fixture}, params={"runs": 4}) == {4}
    assert ranks_started(_computed) == set()


@pytest.mark.parametrize(
    ("fn", "params", "slow"), [(_literal, {}, True), (_loop, {}, True), (_fixture, {}, False)]
)
def test_the_rule_marks_3_ranks_or_more(fn: Any, params: dict[str, Any], slow: bool) -> None:
    assert (max(ranks_started(fn, params=params), default=0) >= MANY_RANKS) is slow
