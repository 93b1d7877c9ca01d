"""torch.compile'd models overlap communication with the compiled backward (issue 27 item 5), with torch's bits.

The probe is structural, not a timing: AOTAutograd runs each compiled graph's backward as one autograd
node (CompiledFunctionBackward). A hook on every such node and a communication hook that records each
bucket's launch give the order of events in the backward (one thread runs both). Overlap exists when
the first bucket is launched before the last compiled node has run: communication then goes on while
backward still computes. With one unsplit graph every gradient is ready only when its single node ends,
so no bucket can launch earlier (the `optimize_ddp=False` case shows that the probe can fail).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import lockstep
from lockstep.testing import run_distributed
from lockstep.testing.parity import assert_tensors_close

STEPS = 3
CAP_MB = 1.0  # 1 MiB buckets: the 512x512 layers (1 MiB each) make several buckets and graph pieces


class Net(nn.Module):
    """Its own forward: dynamo compiles it when it runs inside the wrapper (a bare nn.Sequential under
    torch.compile(DDP(...)) runs eagerly, with torch's DDP as with lockstep's: dynamo skips torch's code)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 512)
        self.hidden = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))
        self.out = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)


def _wrap(engine: str, where: str, module: nn.Module) -> tuple[nn.Module, Any]:
    """(the model to call, the object to register a comm hook on) for one engine and compile placement."""
    inner = torch.compile(module, backend="aot_eager") if where == "inner" else module
    if engine == "replicate":  # "outer": replicate(module), then torch.compile(module)
        policy = lockstep.SyncPolicy(bucket_cap_mb=CAP_MB, first_bucket_mb=CAP_MB)
        handle = lockstep.replicate(inner, policy=policy)
        return (torch.compile(module, backend="aot_eager") if where == "outer" else inner), handle
    cls = lockstep.DistributedDataParallel if engine == "ours" else torch.nn.parallel.DistributedDataParallel
    ddp = cls(inner, bucket_cap_mb=CAP_MB)
    return (torch.compile(ddp, backend="aot_eager") if where == "outer" else ddp), ddp


def _compiled_nodes(root: torch.Tensor) -> list[Any]:
    """Every CompiledFunctionBackward node in the graph of `root` (one per compiled graph piece)."""
    seen, stack, found = set(), [root.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__.startswith("CompiledFunction"):
            found.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return found


def _launch_order(engine: str, where: str, optimize_ddp: bool) -> dict[str, Any]:
    """Per step: how many compiled backward nodes had run when the first bucket launched, and of how many.
    torch's first step reduces in one bucket (both engines): its launch comes after every node."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    events: list[str] = []

    def probe(state, bucket):  # type: ignore[no-untyped-def]  # torch's check wants no string annotation
        events.append("launch")
        return allreduce_hook(state, bucket)

    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
        module = _model()
        model, owner = _wrap(engine, where, module)
        owner.register_comm_hook(None, probe)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        steps = []
        for step in range(STEPS):
            x, y = _batch(rank, step)
            loss = F.cross_entropy(model(x), y)
            nodes = _compiled_nodes(loss)
            handles = [n.register_hook(lambda *_: events.append("node")) for n in nodes]
            events.clear()
            loss.backward()
            for h in handles:
                h.remove()
            first = events.index("launch")
            steps.append({"nodes": len(nodes), "nodes_before_first_launch": events[:first].count("node")})
            opt.step()
            opt.zero_grad()
    torch._dynamo.reset()
    return {"steps": steps}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "where"),
    [("ours", "inner"), ("ours", "outer"), ("replicate", "inner"), ("replicate", "outer")],
)
def test_first_bucket_launches_before_the_compiled_backward_ends(engine: str, where: str) -> None:
    out = run_distributed(_launch_order, 2, args=(engine, where, True), timeout=180)
    for rank, result in enumerate(out):
        for step in result["steps"][1:]:  # the first step has one bucket (torch's, before the rebuild)
            assert step["nodes"] >= 3, f"rank {rank}: dynamo did not split the graph at buckets: {step}"
            assert step["nodes_before_first_launch"] < step["nodes"], f"rank {rank}: no overlap: {step}"


@pytest.mark.slow
def test_torch_ddp_overlaps_by_the_same_probe() -> None:
    """The probe measures what DDPOptimizer gives torch's DDP (the bar lockstep must reach)."""
    out = run_distributed(_launch_order, 2, args=("torch", "inner", True), timeout=180)
    ours = run_distributed(_launch_order, 2, args=("ours", "inner", True), timeout=180)
    for rank in range(2):
        assert out[rank]["steps"][-1]["nodes_before_first_launch"] < out[rank]["steps"][-1]["nodes"]
        assert ours[rank]["steps"][-1]["nodes"] == out[rank]["steps"][-1]["nodes"], (ours, out)
        assert (
            ours[rank]["steps"][-1]["nodes_before_first_launch"]
            <= out[rank]["steps"][-1]["nodes_before_first_launch"]
        ), (ours, out)


@pytest.mark.slow
def test_without_graph_splits_no_bucket_launches_before_backward_ends() -> None:
    """optimize_ddp=False (dynamo leaves the graph whole): the probe sees no overlap, so it can fail."""
    out = run_distributed(_launch_order, 2, args=("ours", "inner", False), timeout=180)
    for result in out:
        for step in result["steps"]:
            assert step == {"nodes": 1, "nodes_before_first_launch": 1}, step


def _trained(engine: str, where: str) -> list[torch.Tensor]:
    torch._dynamo.reset()
    rank = dist.get_rank()
    module = _model()
    model, _ = _wrap(engine, where, module)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch._dynamo.reset()
    return [p.detach().clone() for p in module.parameters()]


def _compare(engine: str, where: str) -> dict[str, list[torch.Tensor]]:
    return {"ours": _trained(engine, where), "torch": _trained("torch", where)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "where"),
    [("ours", "inner"), ("ours", "outer"), ("replicate", "inner"), ("replicate", "outer")],
)
def test_split_compiled_training_equals_torch_ddp_bit_for_bit(engine: str, where: str) -> None:
    out = run_distributed(_compare, 2, args=(engine, where), timeout=180)
    for rank, result in enumerate(out):
        assert_tensors_close(
            result["ours"], result["torch"], 0, 0, what=f"rank {rank} {engine} compile {where}"
        )


def _pieces(policy: dict[str, Any]) -> list[int]:
    """Compiled graph pieces of replicate(torch.compile(module), policy=SyncPolicy(**policy)), 2 steps."""
    torch._dynamo.reset()
    module = _model()
    compiled = torch.compile(module, backend="aot_eager")
    lockstep.replicate(compiled, policy=lockstep.SyncPolicy(**policy))
    pieces = []
    for step in range(2):
        x, y = _batch(dist.get_rank(), step)
        loss = F.cross_entropy(compiled(x), y)
        pieces.append(len(_compiled_nodes(loss)))
        loss.backward()
        module.zero_grad()
    torch._dynamo.reset()
    return pieces


@pytest.mark.slow
def test_low_communication_modes_leave_the_compiled_graph_whole() -> None:
    """local SGD communicates after the optimizer step, never in backward: nothing to overlap, no split."""
    out = run_distributed(_pieces, 2, args=({"sync": "local_sgd", "sync_every": 2},), timeout=120)
    assert out == [[1, 1], [1, 1]], out


@pytest.mark.slow
def test_bucket_size_by_measurement_splits_at_the_default_cap() -> None:
    """bucket_cap_mb="auto": dynamo splits at the first forward, before the tuner chooses: at 25 MiB
    (a first piece of 1 MiB, the rest of this 4 MiB model in a second)."""
    out = run_distributed(_pieces, 2, args=({"bucket_cap_mb": "auto"},), timeout=120)
    assert out == [[2, 2], [2, 2]], out
