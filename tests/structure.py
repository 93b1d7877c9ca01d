"""Reading src/lockstep's structure with ast (nothing is imported): modules, imports, packages, classes.

Shared by tests/unit/test_layers.py (imports point down the layers of DESIGN.md) and
tests/unit/test_structure.py (no import circle, no optimizer below the reducer, object sizes):

- `MODULES`: every module of src/lockstep, name -> path; `module_of(path)`, `package_of(module)`;
- `imported(path)`: (line, lockstep module) for every import in a file, at any depth (inside functions,
  under TYPE_CHECKING: a type-only import is a dependency too), relative imports resolved and
  `from lockstep import fit` mapped to the subpackage that defines `fit`;
- `import_graph()`: module -> {imported module: first line}, edges at module granularity;
- `circles(graph)`: the strongly connected components of more than one node;
- `classes()`: every class statement, with its size and its bases resolved to class statements in
  src/lockstep where they are defined there.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import lockstep

SRC = Path(lockstep.__file__).resolve().parent
ROOT_NAMES: dict[str, str] = dict(lockstep._EXPORTS)  # `from lockstep import fit` -> 'lockstep.trainer'


def module_of(path: Path) -> str:
    """src/lockstep/engine/api.py -> 'lockstep.engine.api'; a package's __init__.py -> the package."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {module_of(path): path for path in sorted(SRC.rglob("*.py"))}


MODULES = _modules()


def part_of(module: str) -> str:
    """The layer a module belongs to (DESIGN.md's table): 'lockstep.engine.api' -> 'engine'; 'lockstep' -> ''."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def package_of(module: str) -> str:
    """The directory a module lives in, as a package: 'lockstep.runtime.membership.group' ->
    'lockstep.runtime.membership', 'lockstep.runtime' -> itself. A module at the top of src/lockstep
    (errors, cli, nn, hooks, the root __init__) is a unit of its own: errors.py sits at the bottom of the
    layers and lockstep/__init__.py at the top, so their common directory is not one package."""
    path = MODULES[module]
    if path.name == "__init__.py" or path.parent == SRC:
        return module
    return module.rpartition(".")[0]


def _from_target(package: str, node: ast.ImportFrom) -> str:
    """The absolute module of `from X import ...` written in `package` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _package_for_relative(path: Path) -> str:
    module = module_of(path)
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute lockstep module) for every import of lockstep code in `path` (or in `source`, read
    as if it were that file). `from pkg import name` gives 'pkg' (the layers care about the package)."""
    package = _package_for_relative(path)
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
                    found.append((node.lineno, ROOT_NAMES.get(alias.name, f"lockstep.{alias.name}")))
            else:
                found.append((node.lineno, target))
    return found


def module_edges(path: Path, modules: dict[str, Path] = MODULES) -> dict[str, int]:
    """The lockstep modules a file imports, each with the first line that does. `from package import name`
    points at the submodule `package.name` when there is one, else at the package; `from lockstep import
    fit` at the subpackage that defines `fit`; `import a.b.c` at the longest prefix that is a module."""
    package = _package_for_relative(path)
    edges: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        edges.setdefault(target, line)
        edges[target] = min(edges[target], line)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name.startswith("lockstep"):
                    add(name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
            if target.split(".")[0] != "lockstep":
                continue
            for alias in node.names:
                if target == "lockstep" and alias.name in ROOT_NAMES:
                    add(ROOT_NAMES[alias.name], node.lineno)
                elif f"{target}.{alias.name}" in modules:
                    add(f"{target}.{alias.name}", node.lineno)
                elif target in modules:
                    add(target, node.lineno)
    return edges


@cache
def import_graph() -> dict[str, dict[str, int]]:
    """module -> {lockstep module it imports: the first line that does}, for every module of src/lockstep."""
    graph = {}
    for module, path in MODULES.items():
        edges = module_edges(path)
        edges.pop(module, None)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]] | dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted (Tarjan's algorithm)."""
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
    return sorted(found)


# ---- classes ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassStatement:
    """One `class` statement of src/lockstep: where it is, how many lines it spans, its bases as written
    (dotted names, subscripts such as Generic[T] reduced to what is subscripted)."""

    module: str
    qualname: str
    line: int
    lines: int
    bases: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.module}.{self.qualname}"

    @property
    def where(self) -> str:
        return f"{MODULES[self.module].relative_to(SRC.parent)}:{self.line}"


def _dotted(node: ast.expr) -> str | None:
    """`a.b.C`, `C[int]`, `a.C[T]` -> the dotted name; anything else (a call, a string) -> None."""
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _statements_of(module: str, tree: ast.Module) -> list[ClassStatement]:
    found: list[ClassStatement] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                qualname = f"{prefix}{child.name}"
                bases = tuple(name for base in child.bases if (name := _dotted(base)))
                end = child.end_lineno or child.lineno
                # A decorated class's statement starts at its first decorator.
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append(ClassStatement(module, qualname, start, end - start + 1, bases))
                visit(child, f"{qualname}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


@dataclass(frozen=True)
class _Names:
    """What a module binds at its top level: classes it defines, names it imports (-> dotted targets),
    plain aliases (`Alias = Other`)."""

    classes: frozenset[str]
    imports: dict[str, str]
    aliases: dict[str, str]


@cache
def _names(module: str) -> _Names:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_for_relative(path)
    classes: set[str] = set()
    imports: dict[str, str] = {}
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):  # imports anywhere (TYPE_CHECKING blocks): a base named there is that class
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    imports[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    imports[top] = top
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
            for alias in node.names:
                imports[alias.asname or alias.name] = f"{target}.{alias.name}"
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes.add(node.name)
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            if (value := _dotted(node.value)) is not None:
                aliases[node.targets[0].id] = value
    return _Names(frozenset(classes), imports, aliases)


def _lockstep_root_target(name: str) -> str:
    """'lockstep.SyncPolicy' -> 'lockstep.engine.SyncPolicy' (the root's lazy names)."""
    head, _, rest = name.partition(".")
    first = rest.split(".")[0]
    if head == "lockstep" and first in ROOT_NAMES and f"lockstep.{first}" not in MODULES:
        return f"{ROOT_NAMES[first]}.{rest}"
    return name


def resolve_class(dotted: str, module: str, *, depth: int = 0) -> str | None:
    """The class statement (its key, 'module.QualName') that the name `dotted`, written in `module`,
    refers to; None when it is not defined in src/lockstep (torch's, the standard library's). A name
    that leads into src/lockstep but to no class statement raises LookupError: the size would be
    undercounted silently otherwise."""
    if depth > 20:
        raise LookupError(f"{dotted!r} in {module}: a chain of re-exports that does not end")
    head, _, rest = dotted.partition(".")
    names = _names(module)
    if head in names.classes:
        return f"{module}.{dotted}"
    if head in names.aliases:
        return resolve_class(".".join(filter(None, [names.aliases[head], rest])), module, depth=depth + 1)
    if head not in names.imports:
        return None  # a builtin (object, Exception) or a name bound otherwise: not a class statement here
    return resolve_absolute(".".join(filter(None, [names.imports[head], rest])), depth=depth + 1)


def resolve_absolute(name: str, *, depth: int = 0) -> str | None:
    """Like resolve_class, for an absolute dotted name ('lockstep.engine.buckets.reducer.Reducer')."""
    name = _lockstep_root_target(name)
    if name.split(".")[0] != "lockstep":
        return None
    pieces = name.split(".")
    for cut in range(len(pieces) - 1, 0, -1):  # the longest prefix that is a module
        owner = ".".join(pieces[:cut])
        if owner in MODULES:
            rest = ".".join(pieces[cut:])
            found = resolve_class(rest, owner, depth=depth + 1)
            # None is fine for a name the owner imports from outside (lockstep.torch_private re-exports
            # torch's _BatchNorm): that class is torch's, not a class statement of src/lockstep
            if found is None and rest.split(".")[0] not in _names(owner).imports:
                raise LookupError(
                    f"{name!r}: {owner} defines no class {rest!r} and imports none by that name"
                )
            return found
    raise LookupError(f"{name!r} names no module of src/lockstep")


@cache
def classes() -> dict[str, ClassStatement]:
    """Every class statement of src/lockstep by key ('lockstep.engine.buckets.reducer.Reducer')."""
    found: dict[str, ClassStatement] = {}
    for module, path in MODULES.items():
        for statement in _statements_of(module, ast.parse(path.read_text(), filename=str(path))):
            found[statement.key] = statement
    return found


def in_repo_bases(statement: ClassStatement) -> list[str]:
    """The keys of a class's direct bases that are class statements of src/lockstep, in written order."""
    scope = statement.module
    found = []
    for base in statement.bases:
        key = resolve_class(base, scope)
        if key is not None:
            found.append(key)
    return found


def lineage(key: str) -> list[str]:
    """A class and every in-repo class it inherits from, each once (the members of its MRO that are
    defined in src/lockstep), the class first, then its bases depth-first in written order."""
    table = classes()
    seen: list[str] = []

    def visit(k: str) -> None:
        if k in seen:
            return
        if k not in table:
            raise LookupError(f"{k}: resolved as a base class, but no class statement has that name")
        seen.append(k)
        for base in in_repo_bases(table[k]):
            visit(base)

    visit(key)
    return seen
