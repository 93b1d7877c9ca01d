"""The layering of DESIGN.md holds: imports point down only and siblings do not import each other; and
the structure limits hold: no import circle between modules (type-only imports count), no module over 400
lines, no class over 300.

Every `import` in src/lockstep (including imports inside functions) is read with ast and mapped to the
lockstep layer it names; the rules below are DESIGN.md's table, plus jobs/ (`lockstep train`) above the
trainer. A second check runs the launcher in a fresh interpreter and asserts it never loads the engine
(`lockstep run` must not break on an engine bug), even after `import lockstep` and `dir(lockstep)`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lockstep

SRC = Path(lockstep.__file__).resolve().parent
L0 = {"errors"}
L1 = {"runtime"}
L2 = {"engine", "data", "checkpoint"}
# What each part may import from lockstep (besides itself): exactly what the code imports today, so that a
# new dependency between parts is a decision (this table and docs/design.md change with it). Every part of
# src/lockstep needs a row (a new package must say where it sits). None = not constrained: lockstep/__init__.py
# (the public names). nn and hooks are the engine's public faces (SyncBatchNorm, comm hooks). jobs sits above
# the trainer: it builds runs from the trainer and launches them with launch's Python API (`lockstep train`).
ALLOWED: dict[str, set[str] | None] = {
    "errors": set(),
    "plan": {"errors"},
    "runtime": L0,
    "engine": L0 | L1,
    "data": L0 | L1,
    "checkpoint": L0 | L1,
    "nn": {"engine"},
    "hooks": {"engine"},
    "launch": L0 | L1 | {"plan"},
    "trainer": L0 | L1 | L2 | {"plan"},
    "jobs": L0 | L1 | {"launch", "trainer", "plan"},
    "": None,
    "cli": L0 | {"launch"},
    "__main__": {"cli"},
    "testing": L0 | L1 | {"engine"},
}
# `from lockstep import fit` reaches the subpackage that defines `fit` (lockstep/__init__.py's table).
_LAZY_ROOT_NAMES: dict[str, str] = dict(lockstep._EXPORTS)


def _part(module: str) -> str:
    """'lockstep.engine.api' -> 'engine'; 'lockstep' -> ''."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def _module_of(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _from_target(package: str, node: ast.ImportFrom) -> str:
    """The absolute module of `from X import ...` written in `package` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _imported(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute lockstep module) for every import of lockstep code in `path` (or in `source`)."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "lockstep"
            ]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
            if target.split(".")[0] != "lockstep":
                continue
            if target == "lockstep":
                for alias in node.names:
                    if alias.name == "__version__":
                        continue
                    found.append((node.lineno, _LAZY_ROOT_NAMES.get(alias.name, f"lockstep.{alias.name}")))
            else:
                found.append((node.lineno, target))
    return found


def _violations() -> list[str]:
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        part = _part(_module_of(path))
        if part not in ALLOWED:
            problems.append(
                f"{path.relative_to(SRC.parent)}: lockstep.{part} has no row in ALLOWED (say where it sits)"
            )
            continue
        allowed = ALLOWED[part]
        if allowed is None:
            continue
        for line, target in _imported(path):
            other = _part(target)
            if other == part:
                continue
            if other not in allowed:
                problems.append(
                    f"{path.relative_to(SRC.parent)}:{line} imports {target} "
                    f"(lockstep.{part} may import only {sorted(allowed) or 'nothing from lockstep'})"
                )
    return problems


def test_imports_follow_the_layers_of_design_md() -> None:
    problems = _violations()
    assert not problems, "layering broken (DESIGN.md, Layers):\n" + "\n".join(problems)


def test_the_table_allows_only_what_the_code_does() -> None:
    """A row wider than the code's imports would let a new dependency in unnoticed."""
    used: dict[str, set[str]] = {part: set() for part in ALLOWED}
    for path in sorted(SRC.rglob("*.py")):
        part = _part(_module_of(path))
        used.setdefault(part, set()).update(
            _part(target) for _line, target in _imported(path) if _part(target) != part
        )
    wider = {
        part: sorted(allowed - used[part])
        for part, allowed in ALLOWED.items()
        if allowed and allowed - used[part]
    }
    assert not wider, f"ALLOWED permits imports that no module makes (tighten it): {wider}"


def test_every_part_is_checked() -> None:
    """jobs went unchecked once: a part without a row in ALLOWED would be skipped silently."""
    parts = {_part(_module_of(path)) for path in SRC.rglob("*.py")}
    assert {"jobs", "trainer", "launch", "engine"} <= parts
    assert parts <= set(ALLOWED), f"parts without a layer rule: {sorted(parts - set(ALLOWED))}"


def test_the_checker_sees_relative_lazy_and_root_imports() -> None:
    """The walker must catch the forms a violation can take, or the check above proves nothing."""
    body = textwrap.dedent(
        """
        from __future__ import annotations
        from ..engine import api
        from lockstep import replicate
        def later():
            import lockstep.trainer.loop
        """
    )
    targets = [target for _line, target in _imported(SRC / "launch" / "_probe.py", body)]
    assert "lockstep.engine" in targets
    assert _LAZY_ROOT_NAMES.get("replicate", "lockstep.replicate") in targets
    assert "lockstep.trainer.loop" in targets


_PROBE = """
import sys
{body}
loaded = sorted(m for m in sys.modules if m.startswith(("lockstep.engine", "lockstep.trainer", "lockstep.data",
                                                        "lockstep.checkpoint", "lockstep.nn", "lockstep.hooks")))
print("LOADED", loaded)
"""


def _loaded_after(body: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(body=textwrap.dedent(body))],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return next(line for line in result.stdout.splitlines() if line.startswith("LOADED"))


def test_launcher_imports_without_the_engine(tmp_path: Path) -> None:
    body = """
    import lockstep
    assert "DistributedDataParallel" in dir(lockstep) and lockstep.__version__  # listed, not loaded
    import lockstep.launch.local, lockstep.launch.envinfo, lockstep.launch.worker
    from lockstep.cli import main
    try:
        main(["run", "--help"])
    except SystemExit:
        pass
    """
    assert _loaded_after(body, tmp_path) == "LOADED []"


@pytest.mark.slow
def test_a_whole_launch_never_loads_the_engine(tmp_path: Path) -> None:
    (tmp_path / "hello.py").write_text("print('hello from the worker')\n")
    body = f"""
    from lockstep.launch.local import launch
    from lockstep.launch.spec import LaunchSpec
    code = launch(LaunchSpec("hello.py", nproc_per_node=1, run_dir={str(tmp_path / "run")!r}))
    assert code == 0, code
    """
    assert _loaded_after(body, tmp_path) == "LOADED []"
    assert (tmp_path / "run" / "rank0" / "stdout.log").read_text() == "hello from the worker\n"


# ---- structure limits (issue 26): no import circle, small modules and classes -------------------------

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    return {_module_of(path): path for path in sorted(SRC.rglob("*.py"))}


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the lockstep modules it imports, at any depth of the file (inside functions, under
    TYPE_CHECKING: a type-only import is an edge too). `from package import name` points at the submodule
    `package.name` when there is one, else at the package; `from lockstep import fit` at the subpackage
    that defines `fit`."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name
                    while name and name not in modules:
                        name = name.rpartition(".")[0]
                    if name.startswith("lockstep"):
                        edges.add(name)
            elif isinstance(node, ast.ImportFrom):
                target = _from_target(package, node)
                if target.split(".")[0] != "lockstep":
                    continue
                for alias in node.names:
                    if target == "lockstep" and alias.name in _LAZY_ROOT_NAMES:
                        edges.add(_LAZY_ROOT_NAMES[alias.name])
                    elif f"{target}.{alias.name}" in modules:
                        edges.add(f"{target}.{alias.name}")
                    elif target in modules:
                        edges.add(target)
        edges.discard(module)
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_of_src_has_no_circle() -> None:
    circles = _circles(_import_graph(_modules()))
    assert not circles, "import circles in src/lockstep (type-only imports count):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_circle_finder_sees_a_circle_through_a_type_only_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_over_400_lines_and_no_class_over_300() -> None:
    problems = []
    for path in _modules().values():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            problems.append(f"{path.relative_to(SRC.parent)}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    problems.append(
                        f"{path.relative_to(SRC.parent)}:{node.lineno} class {node.name}: {size} lines "
                        f"(at most {MAX_CLASS_LINES})"
                    )
    assert not problems, "split these along their seams:\n" + "\n".join(problems)
