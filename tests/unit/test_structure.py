"""Structure facts of src/lockstep (issue 34), read with ast (tests/structure.py), so that they cannot drift:

- no import circle between modules, and none between packages (a package is a directory of src/lockstep:
  runtime/membership is one of its own; a module at the top of src/lockstep is a unit of its own);
  imports inside functions and type-only imports count: either is a dependency;
- nothing below the reducer imports an optimizer: the reducer's modules reach none of the optimizer's;
- the bucketed reducer (engine/buckets/) reaches no module of the periodic sync (engine/periodic/, the
  algorithms, the wire formats), directly or through SyncPolicy: it reads BucketSettings only;
- object sizes: a module is at most 400 lines, a class statement at most 300, and a class measured
  together with the classes it inherits from in src/lockstep (its MRO within the repo: a chain of bases
  that each stay under a limit is still one object) at most 400. Protocols count like any class.

The layering of DESIGN.md (which package may import which) is tests/unit/test_layers.py.
"""

from __future__ import annotations

from collections import deque

import pytest

from tests.structure import (
    MODULES,
    SRC,
    circles,
    classes,
    import_graph,
    lineage,
    package_of,
    resolve_absolute,
)

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300  # one class statement
MAX_OBJECT_LINES = 400  # a class with its in-repo bases

# The reducer's modules (launch, wait and scale per bucket; the exact mode's reducer) and the optimizer's
# (steps, the overlapped and the sharded optimizer): an optimizer is built on the reducer, never under it.
BELOW_THE_REDUCER = (
    "lockstep.engine.buckets.reducer",
    "lockstep.engine.buckets.arrivals",
    "lockstep.engine.buckets.bucket_launch",
    "lockstep.engine.deterministic.exact",
)
OPTIMIZER = (
    "lockstep.engine.optim.optimizer_steps",
    "lockstep.engine.optim.overlapped_optimizer",
    "lockstep.engine.optim.shard_optimizer",
    "lockstep.engine.optim.shard_units",
    "lockstep.engine.optim.shard_overlap",
)


def _where(module: str, line: int | None = None) -> str:
    path = MODULES[module].relative_to(SRC.parent)
    return f"{path}:{line}" if line is not None else str(path)


# ---- import circles ----------------------------------------------------------------------------------------


def test_no_import_circle_between_modules() -> None:
    graph = import_graph()
    problems = []
    for circle in circles(graph):
        members = set(circle)
        edges = [
            f"    {_where(a, line)} imports {b}"
            for a in circle
            for b, line in sorted(graph[a].items())
            if b in members
        ]
        problems.append(" <-> ".join(circle) + "\n" + "\n".join(edges))
    assert not problems, "import circles between modules of src/lockstep (type-only imports count):\n" + (
        "\n".join(problems)
    )


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> {package it imports: the imports that make the edge ('path:line imports module')}."""
    graph: dict[str, dict[str, list[str]]] = {package_of(m): {} for m in MODULES}
    for module, edges in import_graph().items():
        source = package_of(module)
        for target, line in sorted(edges.items()):
            if package_of(target) != source:
                witness = f"{_where(module, line)} imports {target}"
                graph[source].setdefault(package_of(target), []).append(witness)
    return graph


def test_no_import_circle_between_packages() -> None:
    graph = package_graph()
    problems = []
    for circle in circles(graph):
        members = set(circle)
        lines = [" <-> ".join(circle)]
        for a in circle:
            for b, witnesses in sorted(graph[a].items()):
                if b in members:
                    lines.append(f"  {a} -> {b}: " + "; ".join(sorted(witnesses)))
        problems.append("\n".join(lines))
    assert not problems, (
        "import circles between packages of src/lockstep (a package is a directory; move what both sides "
        "need into the lower one, or invert the dependency):\n" + "\n".join(problems)
    )


def test_packages_are_directories_and_top_level_modules_stand_alone() -> None:
    assert package_of("lockstep.runtime.membership.group") == "lockstep.runtime.membership"
    assert package_of("lockstep.runtime.membership") == "lockstep.runtime.membership"
    assert package_of("lockstep.runtime.waits") == "lockstep.runtime"
    assert package_of("lockstep.runtime") == "lockstep.runtime"
    assert package_of("lockstep.errors") == "lockstep.errors"
    assert package_of("lockstep") == "lockstep"


def test_the_circle_finder_sees_a_circle_through_a_type_only_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert circles({"a": {"b": 3}, "b": {"a": 7}, "c": {}}) == [["a", "b"]]


# ---- no optimizer below the reducer --------------------------------------------------------------------------


def chain_to(start: str, targets: set[str], graph: dict[str, dict[str, int]]) -> list[str] | None:
    """The shortest import chain from `start` to a module of `targets` ([start, ..., target]), or None."""
    before: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        if module in targets and module != start:
            chain = [module]
            while (prev := before[chain[-1]]) is not None:
                chain.append(prev)
            return chain[::-1]
        for nxt in sorted(graph.get(module, {})):
            if nxt not in before:
                before[nxt] = module
                queue.append(nxt)
    return None


def test_the_named_reducer_and_optimizer_modules_exist() -> None:
    """The check below would pass vacuously on a renamed module: rename it in these lists too."""
    missing = [m for m in (*BELOW_THE_REDUCER, *OPTIMIZER) if m not in MODULES]
    assert not missing, f"modules named in BELOW_THE_REDUCER/OPTIMIZER that do not exist: {missing}"


def test_no_optimizer_import_below_the_reducer() -> None:
    graph = import_graph()
    problems = []
    for start in BELOW_THE_REDUCER:
        if start not in graph:
            continue
        chain = chain_to(start, set(OPTIMIZER), graph)
        if chain is not None:
            steps = " -> ".join(
                f"{b} ({_where(a, graph[a][b])})" for a, b in zip(chain, chain[1:], strict=False)
            )
            problems.append(f"{start} -> {steps}")
    assert not problems, (
        "the reducer's modules import an optimizer's (an optimizer is built on the reducer; hand the "
        "reducer what it needs instead):\n" + "\n".join(problems)
    )


def test_the_chain_finder_gives_the_shortest_chain() -> None:
    graph = {"r": {"a": 1, "b": 2}, "a": {"c": 1}, "b": {"o": 4}, "c": {"o": 1}, "o": {}}
    assert chain_to("r", {"o"}, graph) == ["r", "b", "o"]
    assert chain_to("a", {"r"}, graph) is None


# ---- the bucketed reducer reaches no periodic sync ------------------------------------------------------------

# The periodic sync's modules: its engine mode (engine/periodic/), the algorithms and the wire formats of
# the outer gradients, and the part of SyncPolicy that holds them. The bucketed reducer reads only its own
# part of the policy (engine/core/bucket_settings.py): none of these is below it, directly or through
# engine/core/policy.py (which imports them).
PERIODIC_SYNC = (
    "lockstep.engine.core.sync_algorithms",
    "lockstep.engine.core.outer_codec",
    "lockstep.engine.core.periodic_settings",
)
BUCKETED_REDUCER = "lockstep.engine.buckets"


def _periodic_sync() -> set[str]:
    periodic = {
        m for m in MODULES if m == "lockstep.engine.periodic" or m.startswith("lockstep.engine.periodic.")
    }
    return periodic | set(PERIODIC_SYNC)


def _bucketed_reducer() -> list[str]:
    return sorted(m for m in MODULES if m == BUCKETED_REDUCER or m.startswith(BUCKETED_REDUCER + "."))


def test_the_named_periodic_modules_exist() -> None:
    """The check below would pass vacuously on a renamed module: rename it in PERIODIC_SYNC too."""
    missing = [m for m in PERIODIC_SYNC if m not in MODULES]
    assert not missing, f"modules named in PERIODIC_SYNC that do not exist: {missing}"
    assert len(_periodic_sync()) > len(PERIODIC_SYNC), "engine/periodic/ has no module"
    assert "lockstep.engine.buckets.reducer" in _bucketed_reducer()


def test_the_bucketed_reducer_imports_no_periodic_module() -> None:
    graph = import_graph()
    targets = _periodic_sync()
    problems = []
    for start in _bucketed_reducer():
        chain = chain_to(start, targets, graph)
        if chain is not None:
            steps = " -> ".join(
                f"{b} ({_where(a, graph[a][b])})" for a, b in zip(chain, chain[1:], strict=False)
            )
            problems.append(f"{start} -> {steps}")
    assert not problems, (
        "engine/buckets/ reaches the periodic sync (read the bucket knobs from BucketSettings, "
        "engine/core/bucket_settings.py, not from SyncPolicy):\n" + "\n".join(problems)
    )


def test_the_periodic_check_sees_the_chain_through_the_policy() -> None:
    """A bucket module that imported SyncPolicy's module would fail the check above: policy.py reaches the
    periodic sync, and the settings module the reducer reads does not."""
    graph = import_graph()
    chain = chain_to("lockstep.engine.core.policy", _periodic_sync(), graph)
    assert chain is not None and chain[0] == "lockstep.engine.core.policy"
    assert chain_to("lockstep.engine.core.bucket_settings", _periodic_sync(), graph) is None
    injected = {**graph, "lockstep.engine.buckets.step": {"lockstep.engine.core.policy": 1}}
    assert chain_to("lockstep.engine.buckets.reducer", _periodic_sync(), injected) is not None


# ---- object sizes -------------------------------------------------------------------------------------------


def test_no_module_over_400_lines() -> None:
    problems = []
    for module, path in MODULES.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            problems.append(f"{_where(module)} ({module}): {lines} lines (at most {MAX_MODULE_LINES})")
    assert not problems, "split these modules along their seams:\n" + "\n".join(problems)


def test_no_class_statement_over_300_lines() -> None:
    problems = [
        f"{c.where} class {c.qualname}: {c.lines} lines (at most {MAX_CLASS_LINES})"
        for c in classes().values()
        if c.lines > MAX_CLASS_LINES
    ]
    assert not problems, "split these classes into parts they hold:\n" + "\n".join(problems)


def test_no_class_over_400_lines_with_its_in_repo_bases() -> None:
    table = classes()
    problems = []
    for key, statement in table.items():
        members = lineage(key)
        total = sum(table[k].lines for k in members)
        if total > MAX_OBJECT_LINES:
            parts = " + ".join(f"{table[k].qualname} {table[k].lines} ({table[k].where})" for k in members)
            problems.append(
                f"{statement.module}.{statement.qualname}: {total} lines with its in-repo bases "
                f"(at most {MAX_OBJECT_LINES}) = {parts}"
            )
    assert not problems, (
        "objects too big (DESIGN.md, has-a not is-a: split a big object into parts it holds, not into a "
        "chain of bases):\n" + "\n".join(problems)
    )


def test_a_class_is_measured_with_the_bases_it_has_in_the_repo() -> None:
    """The resolver follows imports (also `from lockstep import X`) to the class statements, and leaves out
    bases defined elsewhere (torch, the standard library)."""
    table = classes()
    assert lineage("lockstep.runtime.process_group.JoinedTopology") == [
        "lockstep.runtime.process_group.JoinedTopology",
        "lockstep.runtime.env.topology.Topology",
    ]
    config_error = lineage("lockstep.errors.ConfigError")
    assert (
        config_error[0] == "lockstep.errors.ConfigError" and "lockstep.errors.LockstepError" in config_error
    )
    assert lineage("lockstep.errors.LockstepError") == [
        "lockstep.errors.LockstepError"
    ]  # Exception: not ours
    assert resolve_absolute("lockstep.Topology") == "lockstep.runtime.env.topology.Topology"
    assert resolve_absolute("torch.nn.Module") is None
    with pytest.raises(LookupError):
        resolve_absolute("lockstep.runtime.env.topology.NoSuchClass")
    assert all(table[k].lines >= 1 for k in table)
