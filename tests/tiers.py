"""How many ranks a test starts, read from its source at collection: the rule behind the `slow` tier.

A test that starts 3 or more ranks is `slow` (tests/conftest.py adds the mark; nobody writes it by hand).
`ranks_started(item)` reads the test function and everything it reaches in the test code: the helper
functions it calls (in its module, tests/helpers.py, ...), with their arguments bound, and the fixtures it
uses (a parametrized fixture's `request.param` bound to the item's). In that code it finds the world size
of every place that starts ranks:

- `run_distributed(fn, N)`, `run_parity(cases, N)`, `RankPool.run(fn, N)` / `try_run` (second argument, or
  `world_size=` / `world=`);
- a command line with `-n N` / `--nproc-per-node N` (`lockstep run`, `lockstep train`: the strings may be
  spread over a call's arguments, a list or a tuple; `N` may be `"3"`, `str(world)`, a name).

`N` is evaluated where it is a literal, a parametrize value, a module constant, a loop variable over
literals (`for world in (1, 2, 3)`, also unpacked from tuples) or an argument bound at the call; anything
else (computed at run time) is not counted, so a test whose world size is computed must be marked by hand.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
MANY_RANKS = 3  # a test starting this many ranks or more is `slow`
STARTERS = {"run_distributed", "run_parity", "run", "try_run"}  # world size: 2nd positional or keyword
WORLD_KEYWORDS = ("world_size", "world")
RANK_FLAGS = {"-n", "--nproc-per-node", "--nproc_per_node"}
_MAX_DEPTH = 6
_UNKNOWN: list[Any] = []
_HOLE = object()  # an element of a literal tuple whose value the source does not tell

Env = dict[str, list[Any]]


@cache
def _tree_of(fn: Callable[..., Any]) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _is_test_code(fn: Any) -> bool:
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    return code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS)


class _Reader:
    """Walks one test's code; `found` collects every world size it starts."""

    def __init__(self, params: dict[str, Any], command_lines: bool) -> None:
        self.params, self.command_lines = params, command_lines
        self.found: set[int] = set()
        self._seen: set[tuple[Any, ...]] = set()

    def read(self, fn: Callable[..., Any], env: Env, depth: int = 0, fixture: str | None = None) -> None:
        fn = inspect.unwrap(fn)
        tree = _tree_of(fn)
        key = (fn, tuple(sorted((k, repr(v)) for k, v in env.items())), fixture)
        if tree is None or depth > _MAX_DEPTH or key in self._seen:
            return
        self._seen.add(key)
        env = dict(env)
        scope = _Scope(self, fn, env, fixture)
        scope.bind_loops(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                scope.call(node, depth)
            if self.command_lines and isinstance(node, (ast.Call, ast.List, ast.Tuple)):
                items = node.args if isinstance(node, ast.Call) else node.elts
                scope.flags(items)


class _Scope:
    """Names visible in one function: its bound arguments and loop variables, the test's parameters,
    the function's module globals."""

    def __init__(self, reader: _Reader, fn: Callable[..., Any], env: Env, fixture: str | None) -> None:
        self.reader, self.fn, self.env, self.fixture = reader, fn, env, fixture
        self.globals: dict[str, Any] = getattr(fn, "__globals__", {})

    def values(self, node: ast.expr) -> list[Any]:
        """Every value `node` may have here ([] when it cannot be told from the source)."""
        if isinstance(node, ast.Constant):
            return [node.value]
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            if node.id in self.reader.params:
                return [self.reader.params[node.id]]
            if node.id in self.globals and isinstance(self.globals[node.id], (int, str, tuple, list, range)):
                return [self.globals[node.id]]
            return _UNKNOWN
        if isinstance(node, ast.Attribute) and node.attr == "param" and self.fixture in self.reader.params:
            return [self.reader.params[self.fixture]]
        if isinstance(node, (ast.Tuple, ast.List)):  # an element the source does not tell stays a hole
            return [tuple(v[0] if len(v) == 1 else _HOLE for v in map(self.values, node.elts))]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
            bounds = [self.values(arg) for arg in node.args]
            if 1 <= len(bounds) <= 3 and all(len(b) == 1 and isinstance(b[0], int) for b in bounds):
                return [range(*(b[0] for b in bounds))]
            return _UNKNOWN
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1:
            convert = {"str": str, "int": int}.get(node.func.id)
            if convert is not None:
                out = []
                for value in self.values(node.args[0]):
                    try:
                        out.append(convert(value))
                    except (TypeError, ValueError):
                        pass
                return out
        return _UNKNOWN

    def bind_loops(self, tree: ast.AST) -> None:
        """`NAME = VALUE`, then `for T in ITER` and comprehensions over what the source tells: T takes
        every element (a tuple target unpacks each)."""
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                if value := self.values(node.value):
                    self.env.setdefault(node.targets[0].id, []).extend(value)
        for node in ast.walk(tree):
            pairs: list[tuple[ast.expr, ast.expr]] = []
            if isinstance(node, (ast.For, ast.AsyncFor)):
                pairs.append((node.target, node.iter))
            elif isinstance(node, ast.comprehension):
                pairs.append((node.target, node.iter))
            for target, iterable in pairs:
                for each in self.values(iterable):
                    for element in _elements(each):
                        self._bind(target, element)

    def _bind(self, target: ast.expr, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.env.setdefault(target.id, []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (tuple, list)):
            if len(target.elts) == len(value):
                for t, v in zip(target.elts, value, strict=True):
                    self._bind(t, v)

    def _world(self, node: ast.expr) -> None:
        for value in self.values(node):
            number = _as_int(value)
            if number is not None:
                self.reader.found.add(number)

    def flags(self, items: list[ast.expr]) -> None:
        """`"-n", N` (or `--nproc-per-node`) in a call's arguments, a list or a tuple: the first one only
        (lockstep's flags come before the script; a later `-n` is the script's own argument)."""
        for flag, value in zip(items, items[1:], strict=False):
            if isinstance(flag, ast.Constant) and flag.value in RANK_FLAGS:
                self._world(value)
                return

    def call(self, node: ast.Call, depth: int) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name in STARTERS:
            world = node.args[1] if len(node.args) > 1 else None
            for keyword in node.keywords:
                if keyword.arg in WORLD_KEYWORDS:
                    world = keyword.value
            if world is not None:
                self._world(world)
        if not isinstance(node.func, ast.Name):
            return
        callee = None if node.func.id in self.env else self.globals.get(node.func.id)
        if _is_test_code(callee):
            self.reader.read(callee, self._arguments(callee, node), depth + 1)

    def _arguments(self, callee: Callable[..., Any], node: ast.Call) -> Env:
        """The callee's parameters bound to what the call passes (where the source tells)."""
        try:
            signature = inspect.signature(callee)
        except (TypeError, ValueError):
            return {}
        names = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        bound: Env = {}
        for parameter in signature.parameters.values():
            if parameter.default is not parameter.empty and isinstance(parameter.default, (int, str, tuple)):
                bound[parameter.name] = [parameter.default]
        for name, arg in zip(names, node.args, strict=False):
            if not isinstance(arg, ast.Starred) and (value := self.values(arg)):
                bound[name] = value
        for keyword in node.keywords:
            if keyword.arg is not None and (value := self.values(keyword.value)):
                bound[keyword.arg] = value
        return bound


def _elements(value: Any) -> Iterator[Any]:
    if isinstance(value, (tuple, list, range)):
        yield from value


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def ranks_started(
    test: Callable[..., Any],
    *,
    params: dict[str, Any] | None = None,
    fixtures: dict[str, Callable[..., Any]] | None = None,
    command_lines: bool = True,
) -> set[int]:
    """The world sizes that `test` starts, read from its source and from the test code it reaches:
    `params` are the item's parameters (parametrize values, a parametrized fixture's under its name),
    `fixtures` the test code's fixture functions it uses, by name. `command_lines=False`: `-n N` in a
    list of strings is not read (a unit test parses such lists; it starts nothing)."""
    reader = _Reader(dict(params or {}), command_lines)
    reader.read(test, {})
    for name, fixture in (fixtures or {}).items():
        if _is_test_code(fixture):
            reader.read(fixture, {}, fixture=name)
    return reader.found


def ranks_of_item(item: Any) -> set[int]:
    """ranks_started for a collected pytest item (its function, parameters and fixtures). tests/unit
    starts no processes (pure logic): the command lines its tests build are parsed, not run."""
    callspec = getattr(item, "callspec", None)
    params = dict(callspec.params) if callspec is not None else {}
    info = getattr(item, "_fixtureinfo", None)
    fixtures: dict[str, Callable[..., Any]] = {}
    for name, defs in (getattr(info, "name2fixturedefs", None) or {}).items():
        if defs:
            fixtures[name] = defs[-1].func
    function = getattr(item, "function", None)
    if function is None:
        return set()
    unit = Path(item.path).resolve().is_relative_to(TESTS / "unit")
    return ranks_started(function, params=params, fixtures=fixtures, command_lines=not unit)
