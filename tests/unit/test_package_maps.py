"""Every package of src/lockstep is a room a newcomer can read: at most 20 modules in one folder, and its
docstring maps what is in it (a line `- name.py: ...` for each module, `- name/: ...` for each
subpackage), no more and no less."""

from __future__ import annotations

import ast
import re

from tests.structure import SRC

MAX_MODULES = 20  # .py files directly in one folder, __init__.py included
ENTRY = re.compile(r"^- (\w+\.py|\w+/): ", re.M)


def _packages() -> list:
    return sorted(d for d in [SRC, *SRC.rglob("*")] if d.is_dir() and (d / "__init__.py").exists())


def test_no_folder_of_src_lockstep_holds_more_than_20_modules() -> None:
    crowded = {
        str(d.relative_to(SRC.parent)): n
        for d in [SRC, *SRC.rglob("*")]
        if d.is_dir() and (n := len(list(d.glob("*.py")))) > MAX_MODULES
    }
    assert not crowded, f"folders with more than {MAX_MODULES} .py files (group them by seam): {crowded}"


def test_each_package_docstring_maps_exactly_its_modules_and_subpackages() -> None:
    problems = []
    for package in _packages():
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        mapped = set(ENTRY.findall(doc))
        present = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
        present |= {d.name + "/" for d in package.iterdir() if (d / "__init__.py").exists()}
        where = package.relative_to(SRC.parent)
        if missing := sorted(present - mapped):
            problems.append(f"{where}/__init__.py does not map {missing}")
        if stale := sorted(mapped - present):
            problems.append(f"{where}/__init__.py maps what is not there: {stale}")
    assert not problems, "\n".join(problems)


def test_the_map_check_sees_a_missing_and_a_stale_entry() -> None:
    doc = "Intro.\n\nModules:\n- a.py: one\n- gone.py: two\n- sub/: three\n  continued - b.py: not an entry\n"
    assert set(ENTRY.findall(doc)) == {"a.py", "gone.py", "sub/"}
