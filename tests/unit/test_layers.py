"""The layering of DESIGN.md holds: imports point down only and siblings do not import each other.

Every `import` in src/lockstep (including imports inside functions) is read with ast (tests/structure.py)
and mapped to the lockstep layer it names; the rules below are DESIGN.md's table, plus jobs/ (`lockstep train`) above the
trainer. A second check runs the launcher in a fresh interpreter and asserts it never loads the engine
(`lockstep run` must not break on an engine bug), even after `import lockstep` and `dir(lockstep)`.
The other structure rules (no import circle, object sizes) are tests/unit/test_structure.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.structure import ROOT_NAMES, SRC, imported, module_of, part_of

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
    "torch_private": set(),  # torch's private names, read in one place (imports torch only)
    "plan": {"errors", "plan_table", "plan_settings"},  # the table's and the settings' modules, re-exported
    "plan_settings": {"plan_table"},
    "plan_table": {"errors"},
    "runtime": L0 | {"torch_private"},
    "engine": L0 | L1 | {"plan", "torch_private"},
    "data": L0 | L1,
    "checkpoint": L0 | L1 | {"torch_private"},  # DCP's private names (sharded checkpoints)
    "nn": {"engine"},
    "hooks": {"engine"},
    "launch": L0 | L1 | {"startup"},
    # lockstep's class under torch's names and the Lightning strategy: stdlib at import, the engine when used
    "startup": {"engine"},
    "trainer": L0 | L1 | L2 | {"plan", "torch_private"},
    "jobs": L0 | L1 | {"launch", "trainer", "plan"},
    "": None,
    "cli": L0 | {"launch"},
    "__main__": {"cli"},
    "testing": L0 | L1 | {"engine"},
}


def _violations() -> list[str]:
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        part = part_of(module_of(path))
        if part not in ALLOWED:
            problems.append(
                f"{path.relative_to(SRC.parent)}: lockstep.{part} has no row in ALLOWED (say where it sits)"
            )
            continue
        allowed = ALLOWED[part]
        if allowed is None:
            continue
        for line, target in imported(path):
            other = part_of(target)
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
        part = part_of(module_of(path))
        used.setdefault(part, set()).update(
            part_of(target) for _line, target in imported(path) if part_of(target) != part
        )
    wider = {
        part: sorted(allowed - used[part])
        for part, allowed in ALLOWED.items()
        if allowed and allowed - used[part]
    }
    assert not wider, f"ALLOWED permits imports that no module makes (tighten it): {wider}"


def test_every_part_is_checked() -> None:
    """jobs went unchecked once: a part without a row in ALLOWED would be skipped silently."""
    parts = {part_of(module_of(path)) for path in SRC.rglob("*.py")}
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
    targets = [target for _line, target in imported(SRC / "launch" / "_probe.py", body)]
    assert "lockstep.engine" in targets
    assert ROOT_NAMES.get("replicate", "lockstep.replicate") in targets
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
