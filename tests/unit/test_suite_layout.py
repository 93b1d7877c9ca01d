"""The test suite's own rules: no test module imports another, shared helpers live in tests/helpers.py only,
and tests that start processes never pick a port number themselves (the kernel does: port 0)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# What a test module may import from this package: the one helpers module, and the
# readers behind the suite's rules (stdlib only): src/lockstep's structure, and a test's rank count (tiers).
SHARED = ("tests.helpers", "tests.structure", "tests.tiers")


def _test_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, relative ones resolved, names of `from X import a`
    included as X.a (a module imported that way is a module too)."""
    package = _module_name(path).rsplit(".", 1)[0].split(".")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def test_no_test_module_imports_another_test_module() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line} imports {name}"
        for path in _test_modules()
        for line, name in _imports(path)
        if name.startswith("tests.") and any(part.startswith("test_") for part in name.split(".")[1:])
    ]
    assert not offenders, "move what is shared into tests/helpers.py:\n" + "\n".join(offenders)


def test_test_modules_share_code_only_through_the_helpers_module() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line} imports {name}"
        for path in _test_modules()
        for line, name in _imports(path)
        if (name == "tests" or name.startswith("tests."))
        and not any(name == shared or name.startswith(shared + ".") for shared in SHARED)
    ]
    assert not offenders, "shared test code belongs in tests/helpers.py:\n" + "\n".join(offenders)


# A port written into a test that starts processes: `host:29500`, MASTER_PORT="29511", 29000 + pid % 2000.
# (Unit tests may parse endpoints such as "10.0.0.1:29500": nothing binds them.)
GUESSED_PORT = (
    re.compile(r"""["'][^"'\n]*:[1-9]\d{3,4}["']"""),  # "...:29400" (":0" lets the kernel pick)
    re.compile(r"""MASTER_PORT["']?\s*[:=]\s*["']?\d"""),
    re.compile(r"getpid\(\)\s*%"),
)


def test_tests_that_start_processes_let_the_kernel_pick_ports() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{number}: {line.strip()}"
        for directory in ("cli", "multiproc", "gpu")
        for path in sorted((TESTS / directory).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(pattern.search(line) for pattern in GUESSED_PORT)
    ]
    assert not offenders, (
        "a port picked by the test can be taken; bind port 0 (tests.helpers.free_port, "
        "Host.free_port in a namespace) or let the component pick:\n" + "\n".join(offenders)
    )


def test_no_benchmark_or_tool_imports_the_test_suite() -> None:
    """What the benchmarks and the test suite share (the multi-host test bed) lives at the top of the
    repository (testbed/), not under tests/: a benchmark never imports tests."""
    root = TESTS.parent
    offenders = [
        f"{path.relative_to(root)}:{line} imports {name}"
        for folder in ("benchmarks", "tools", "testbed")
        for path in sorted((root / folder).rglob("*.py"))
        for line, name in _imports(path)
        if name == "tests" or name.startswith("tests.")
    ]
    assert not offenders, "share it through testbed/ (or src/lockstep):\n" + "\n".join(offenders)
