"""Where a sharded model's training steps begin and end, for the hang watchdog and the straggler reports."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.engine.core.init_sync import broadcast_coalesced
from lockstep.runtime.progress import BACKWARD, PROGRESS
from lockstep.torch_private import execution_engine, pytree


class StepMarks:
    """Where a sharded model's training steps begin and end, for the hang watchdog and the straggler
    reports (runtime/progress.py), as the replicated engine marks its own: a forward with gradients
    begins a step, its backward's first gradient starts the backward phase, and the backward's end ends
    the step (a callback queued on autograd's engine). With `sync_buffers`, such a forward first takes
    rank 0's buffers (BatchNorm's running statistics), as torch's DDP does: FSDP2 shards parameters only,
    and each rank's buffers would drift apart; with `group` (a periodic sync's replica group, which keeps its
    own until the round's end), the group's first rank's."""

    def __init__(
        self, module: nn.Module, *, sync_buffers: bool, group: dist.ProcessGroup | None = None
    ) -> None:
        self._queued = False
        self.buffers = list(module.buffers()) if sync_buffers else []
        self.group = group  # whose first rank's buffers (None: the world's rank 0)
        self.source = dist.get_global_rank(group, 0) if group is not None else 0
        self.handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True),
            module.register_forward_hook(self._post_forward),
        ]

    def _pre_forward(self, _module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():
            PROGRESS.begin_step()
            if self.buffers and dist.get_world_size(self.group) > 1:
                broadcast_coalesced(self.buffers, self.source, self.group)

    def _post_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        first = next(
            (t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None
        )
        if first is not None:
            first.register_hook(self._on_output_grad)

    def _on_output_grad(self, _grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            PROGRESS.set_phase(BACKWARD)
            execution_engine.queue_callback(self._end_step)

    def _end_step(self) -> None:
        self._queued = False
        PROGRESS.end_step()
