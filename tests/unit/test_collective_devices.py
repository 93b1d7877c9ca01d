"""Every tensor lockstep makes for a collective is made on the group's device (CPU for gloo, CUDA for nccl).

An NCCL group rejects CPU tensors, and no GPU is here to show it, so two checks stand in: the device
decision itself (a pure function of the backend's declared capability), and a scan of every module that
issues collectives: each tensor factory call there names a device, is moved with `.to(...)` before use,
or is listed below with the reason it never reaches a collective. A new `torch.tensor([...])` handed to
`dist.all_reduce` without a device fails this test.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from lockstep.runtime.collectives import device_for_backend

SRC = Path(__file__).resolve().parents[2] / "src" / "lockstep"
COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
}
FACTORIES = {
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "frombuffer",
    "arange",
    "randn",
    "rand",
    "randint",
    "sparse_coo_tensor",
}
# (file, factory, line text fragment) -> why the tensor never reaches a collective as it is
NOT_SENT = {
    (
        "runtime/collectives.py",
        "frombuffer",
        "torch.frombuffer(bytearray(data)",
    ): "_encode: callers .to(device)",
    ("runtime/collectives.py", "empty", "torch.empty(0, dtype=torch.uint8)"): "_encode: callers .to(device)",
    (
        "engine/buckets/bucket_memory.py",
        "empty",
        "torch.empty(0, dtype=dtype)",
    ): "a solo bucket's unused placeholder",
    (
        "engine/comm/powersgd.py",
        "empty",
        "torch.empty(0)",
    ): "placeholder replaced before any collective",
    (
        "engine/comm/powersgd.py",
        "randn",
        "torch.randn(mem.q.numel(), generator",
    ): "copied into Q (on its device)",
    ("data/gather.py", "empty", "torch.empty(0, *shape, dtype=dtype)"): "copied into a comm_device buffer",
    ("data/gather.py", "arange", "torch.arange(num_samples)"): "local comparison of indices",
}


def test_nccl_needs_its_cuda_device_and_gloo_takes_cpu() -> None:
    assert device_for_backend(["cuda"], lambda: 3) == torch.device("cuda", 3)
    assert device_for_backend(["cpu", "cuda"], lambda: 3) == torch.device("cpu")
    assert device_for_backend(torch.distributed.Backend.backend_capability["nccl"], lambda: 1).type == "cuda"
    assert device_for_backend(torch.distributed.Backend.backend_capability["gloo"], lambda: 1).type == "cpu"


def _issues_collectives(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and node.attr in COLLECTIVES
        and isinstance(node.value, ast.Name)
        and node.value.id == "dist"
        for node in ast.walk(tree)
    )


def _unplaced_factories(path: Path) -> list[tuple[str, str, str]]:
    text = path.read_text()
    tree = ast.parse(text)
    if not _issues_collectives(tree):
        return []
    moved = {
        id(node.func.value)
        for node in ast.walk(tree)  # torch.zeros(...).to(device)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "to"
        and isinstance(node.func.value, ast.Call)
    }
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            continue
        if any(k.arg == "device" for k in node.keywords) or id(node) in moved:
            continue
        found.append((str(path.relative_to(SRC)), node.func.attr, ast.get_source_segment(text, node) or ""))
    return found


def test_every_tensor_made_for_a_collective_names_its_device() -> None:
    unplaced = [f for path in sorted(SRC.rglob("*.py")) for f in _unplaced_factories(path)]
    unexplained = [
        f
        for f in unplaced
        if not any(f[0] == k[0] and f[1] == k[1] and f[2].startswith(k[2]) for k in NOT_SENT)
    ]
    assert not unexplained, (
        "tensors made without a device in modules that issue collectives (create them on "
        f"comm_device(group) or list why they never reach one): {unexplained}"
    )
    assert len(unplaced) >= 4  # the scan sees the known placeholders: it is looking at the right code
