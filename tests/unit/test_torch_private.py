"""lockstep.torch_private: every private name of torch's that lockstep reads exists in the installed torch,
and no other module of lockstep reads one (launch/worker.py's excepthook name aside: it must not import
torch). A torch upgrade that renames one fails here, by name, rather than in a training run."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import lockstep.torch_private as torch_private
from tests.structure import SRC

# Modules allowed to name a private attribute of torch's: this one's subject, and the worker's bootstrap.
ALLOWED = {"torch_private.py", "launch/worker.py"}
ROOTS = {"torch", "dist", "c10d", "nn", "F", "TorchDDP"}


def test_every_name_resolves_in_the_installed_torch() -> None:
    missing = [name for name in torch_private.__all__ if not hasattr(torch_private, name)]
    assert not missing, missing
    assert callable(torch_private.foreach_copy_) and callable(torch_private.disable_dynamo)
    assert hasattr(torch_private.execution_engine, "queue_callback")
    assert issubclass(torch.nn.BatchNorm1d, torch_private.BatchNormBase)
    assert hasattr(torch_private.JoinConfig, "construct_disabled_join_config")
    assert torch_private.pytree.tree_leaves({"a": [1, (2, 3)]}) == [1, 2, 3]
    assert torch_private.default_pg() is None or torch.distributed.is_initialized()
    assert torch_private.active_ddp_module() is None or torch_private.active_ddp_module() is not None


def test_the_functions_reach_torchs_names() -> None:
    """The functions read their names when called: each exists on the module it reads it from."""
    c10d = torch.distributed.distributed_c10d
    for name in ("_world", "_get_default_group", "_get_default_store", "_set_pg_timeout"):
        assert hasattr(c10d, name), name
    assert hasattr(c10d._world, "default_pg") and hasattr(c10d._world, "pg_coalesce_state")
    assert hasattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module")


def _private_torch_names(path: Path) -> list[str]:
    """`from torch... import _x`, `from torch._x import ...` and `torch._x` / `dist._x` style reads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            if any(part.startswith("_") for part in module.split(".")):
                found.append(f"{node.lineno}: from {module}")
            found += [f"{node.lineno}: {module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in ROOTS:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_other_module_reads_a_private_name_of_torchs() -> None:
    offenders = [
        f"src/lockstep/{path.relative_to(SRC)}:{hit}"
        for path in sorted(SRC.rglob("*.py"))
        if str(path.relative_to(SRC)) not in ALLOWED
        for hit in _private_torch_names(path)
    ]
    assert not offenders, "read it through lockstep/torch_private.py:\n" + "\n".join(offenders)
