"""Every `raise` in src/lockstep names a LockstepError subclass or re-raises what it caught (issue 15).

The rule (lockstep.errors): a user can catch everything lockstep raises on purpose as LockstepError, and
each class may also subclass the builtin torch raises in the same situation. This test reads every
module with `ast` and accepts, for each `raise`:

- a bare `raise`;
- `raise name` (or `raise name from ...`) inside the `except ... as name` handler that bound it;
- `raise C(...)` / `raise C` where C, imported and resolved now (module globals, or an import inside the
  enclosing functions), is a class that subclasses LockstepError;
- an entry of ALLOWED: a protocol exception that cannot be anything else, with the reason.

Each offender is printed as `path:line: raise X (why)`, so that the list is a to-do list.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockstep.errors import LockstepError

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "lockstep"

# (file under src/lockstep, exception name) -> why it cannot be a LockstepError subclass. Only protocol
# exceptions belong here (StopIteration ending an iterator, SystemExit carrying an exit status); none is
# raised today: the worker's exit status goes through sys.exit(code), and every other protocol (argparse's
# ArgumentTypeError, AttributeError from __getattr__, torch's SignalException) accepts a subclass that is
# also a LockstepError.
ALLOWED: dict[tuple[str, str], str] = {
    ("runtime/waits.py", "error"): "the failure of a wait run on another thread (gloo's reduce-scatter), "
    "raised on the waiting thread as wait() raised it: a lost peer's transport error stays one",
}


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _ancestors(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> Iterator[ast.AST]:
    while node in parents:
        node = parents[node]
        yield node


def _bound_by_handler(name: str, node: ast.Raise, parents: dict[ast.AST, ast.AST]) -> bool:
    """`raise name` inside the `except ... as name` that bound it (in the same function)."""
    for ancestor in _ancestors(node, parents):
        if isinstance(ancestor, ast.ExceptHandler) and ancestor.name == name:
            return True
        if isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return False
    return False


def _dotted(expr: ast.expr) -> list[str] | None:
    """`a.b.C` as ['a', 'b', 'C']; None for anything that is not a plain dotted name."""
    if isinstance(expr, ast.Name):
        return [expr.id]
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return None if head is None else [*head, expr.attr]
    return None


def _local_import(name: str, node: ast.Raise, parents: dict[ast.AST, ast.AST], package: str) -> object | None:
    """What `name` is bound to by an import statement in a function enclosing `node`, or None."""
    for ancestor in _ancestors(node, parents):
        if not isinstance(ancestor, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for stmt in ast.walk(ancestor):
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        base = importlib.import_module("." * stmt.level + (stmt.module or ""), package)
                        return getattr(base, alias.name, None)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name or (alias.asname is None and alias.name.split(".")[0] == name):
                        return importlib.import_module(alias.name if alias.asname else name)
    return None


def _resolve(parts: list[str], node: ast.Raise, parents: dict[ast.AST, ast.AST], module_name: str) -> object:
    module = importlib.import_module(module_name)
    head = vars(module).get(parts[0])
    if head is None:
        head = _local_import(parts[0], node, parents, module.__package__ or "")
    if head is None:
        head = getattr(builtins, parts[0], None)
    for attr in parts[1:]:
        head = getattr(head, attr, None)
    return head


def offending_raises(path: Path, src: Path) -> list[str]:
    """`path:line: raise X (why)` for every raise in `path` that breaks the rule."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = _parents(tree)
    relative = (
        path.relative_to(src / "lockstep").as_posix() if (src / "lockstep") in path.parents else path.name
    )
    shown = path.relative_to(src.parent).as_posix() if src.parent in path.parents else str(path)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue  # a bare `raise` re-raises what is being handled
        expr = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        parts = _dotted(expr)
        text = ast.unparse(expr) if parts is None else ".".join(parts)
        if parts is None:
            found.append((node.lineno, f"{shown}:{node.lineno}: raise {text} (not a class name)"))
            continue
        if (
            len(parts) == 1
            and not isinstance(node.exc, ast.Call)
            and _bound_by_handler(parts[0], node, parents)
        ):
            continue  # `except ... as exc: ... raise exc`
        if (relative, parts[-1]) in ALLOWED:
            continue
        target = _resolve(parts, node, parents, _module_name(path, src))
        if isinstance(target, type) and issubclass(target, LockstepError):
            continue
        why = (
            f"{target.__name__} is not a LockstepError subclass"
            if isinstance(target, type)
            else f"{text} does not resolve to an exception class here"
        )
        found.append((node.lineno, f"{shown}:{node.lineno}: raise {text} ({why})"))
    return [line for _, line in sorted(found)]


def _allowed_in_use() -> set[tuple[str, str]]:
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                expr = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                parts = _dotted(expr)
                if parts and (relative, parts[-1]) in ALLOWED:
                    used.add((relative, parts[-1]))
    return used


def test_every_raise_in_lockstep_names_a_lockstep_error() -> None:
    found = [line for path in sorted(PACKAGE.rglob("*.py")) for line in offending_raises(path, SRC)]
    assert not found, (
        f"{len(found)} raise(s) name no LockstepError subclass; raise one (it may also subclass the builtin "
        "torch raises, see lockstep/errors.py), re-raise what was caught, or, for a protocol exception that "
        "cannot be anything else, add it to ALLOWED with the reason:\n" + "\n".join(found)
    )


def test_every_allowed_entry_is_still_needed() -> None:
    stale = sorted(set(ALLOWED) - _allowed_in_use())
    assert not stale, f"ALLOWED entries no raise uses any more; remove them: {stale!r}"


_SAMPLE = """
from lockstep.errors import ConfigError, InternalError


class Local(Exception):
    pass


def good(x):
    if x == 1:
        raise ConfigError("seen 1")
    if x == 2:
        raise InternalError
    try:
        pass
    except ValueError as exc:
        raise exc from None
    except KeyError:
        raise
    from lockstep.errors import CheckpointError
    raise CheckpointError("local import")


def bad(x):
    if x == 1:
        raise ValueError("builtin")
    if x == 2:
        raise Local()
    err = ConfigError("kept")
    if x == 3:
        raise err
    try:
        pass
    except ValueError as exc:
        pass
    raise make_error()


def make_error():
    return ConfigError("made")
"""


def test_the_checker_flags_what_breaks_the_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "sample_errors_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    module = package / "mod.py"
    module.write_text(_SAMPLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sample_errors_pkg", raising=False)
    found = offending_raises(module, tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == [
        "raise ValueError (ValueError is not a LockstepError subclass)",
        "raise Local (Local is not a LockstepError subclass)",
        "raise err (err does not resolve to an exception class here)",
        "raise make_error (make_error does not resolve to an exception class here)",
    ], found
