"""docs/design.md stays the map of the code: it names every module of src/lockstep, and every file it
names exists (a module renamed or removed without the map changing fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import lockstep

SRC = Path(lockstep.__file__).resolve().parent
ROOT = SRC.parents[1]
DESIGN = ROOT / "docs" / "design.md"
# `pkg/module.py`, `module.py`, or a documentation page such as `engine.md`
_FILE = re.compile(r"(?<![\w./-])((?:[a-z_]+/)*[a-z_]+\.(?:py|md))\b")


def _modules() -> set[str]:
    return {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}


def _exists(name: str, modules: set[str]) -> bool:
    if name in modules or (ROOT / name).exists() or (DESIGN.parent / name).exists():
        return True
    if "/" not in name:  # a module named within its package's row: it must exist in some package
        return any(m == name or m.endswith(f"/{name}") for m in modules) or any(ROOT.glob(f"*/{name}"))
    return any(m.endswith(f"/{name}") for m in modules) or any(ROOT.glob(f"*/{name}"))


def test_design_names_every_module_of_src() -> None:
    text = DESIGN.read_text()
    missing = sorted(m for m in _modules() if f"`{m}`" not in text)
    assert not missing, f"docs/design.md does not name these modules (add them to its index): {missing}"


def test_every_file_design_names_exists() -> None:
    modules = _modules()
    named = set(_FILE.findall(DESIGN.read_text()))
    stale = sorted(name for name in named if not _exists(name, modules))
    assert not stale, f"docs/design.md names files that do not exist: {stale}"


def test_the_checker_sees_a_stale_name() -> None:
    assert _FILE.findall("see `engine/float_step.py` and api.py, then [live.md](live.md)") == [
        "engine/float_step.py",
        "api.py",
        "live.md",
        "live.md",
    ]
    assert not _exists("engine/float_step.py", _modules())
