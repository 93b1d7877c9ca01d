"""torch.compile: dynamo splits a replica's compiled graphs at bucket boundaries, as it does for torch's DDP.

Why. AOTAutograd turns a compiled forward's backward into one autograd node: every parameter's gradient
is ready only when that node ends, so the engine's per-parameter hooks all fire at the end of backward
and no bucket is launched before the compiled backward is over (no overlap; measured in
benchmarks/results/2026-11-26-compile_overlap.md). torch's DDP gets around this with dynamo's
DDPOptimizer (torch/_dynamo/backends/distributed.py): while DDP runs its module's forward, the class
attribute `torch.nn.parallel.DistributedDataParallel._active_ddp_module` names it, and a frame dynamo
compiles then is split, walking the graph from its end, every `bucket_bytes_cap` bytes of parameters
(the first piece at 1 MiB). Each piece has its own backward node, so the last layers' gradients are
ready, and their buckets launch, while the earlier pieces' backward still runs.

lockstep sets the same attribute around its module's forward: the drop-in class names itself (in
its forward, written out there: a context manager per step costs more than the rest of its forward) (torch's
cap, so dynamo splits exactly as for torch's DDP: the same compiled graphs, the same bits), `replicate`
names a `DynamoView` of its policy's cap. Dynamo reads the attribute only when it compiles a frame,
and only with `torch._dynamo.config.optimize_ddp` set (torch's default); frames compiled outside it
stay whole, as under torch's DDP.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lockstep.engine.core.policy import SyncPolicy
from lockstep.torch_private import active_ddp_module, set_active_ddp_module

# dynamo's first piece is torch's first bucket (1 MiB); it refuses a cap below that
_DYNAMO_FIRST_BUCKET_BYTES = 1024 * 1024


class DynamoView:
    """What dynamo reads of the DDP module it compiles for: the bucket cap (replicate's stand-in). With
    bucket_cap_mb="auto" the default's: dynamo splits once, at the first forward, before the tuner chooses."""

    def __init__(self, policy: SyncPolicy) -> None:
        self.bucket_bytes_cap = max(policy.bucket_cap_bytes, _DYNAMO_FIRST_BUCKET_BYTES)


class SplitHooks:
    """replicate's hooks that set the attribute around the module's forward (torch's composable
    replicate does the same); the post-hook is always called, so an exception does not leave it set."""

    def __init__(self, policy: SyncPolicy) -> None:
        self.view = DynamoView(policy)
        self._before: list[Any] = []  # a stack: a replica may run inside another's forward

    def enter(self, _module: nn.Module, _args: Any) -> None:
        self._before.append(active_ddp_module())
        set_active_ddp_module(self.view)  # dynamo reads bucket_bytes_cap only

    def leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._before:
            set_active_ddp_module(self._before.pop())

    def register(self, module: nn.Module) -> list[Any]:
        """The two hooks on `module`; their handles, to remove with the replica's."""
        return [
            module.register_forward_pre_hook(self.enter, prepend=True),  # before replicate's pre_forward
            module.register_forward_hook(self.leave, always_call=True),
        ]
