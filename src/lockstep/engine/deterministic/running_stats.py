"""BatchNorm running statistics in deterministic mode: as if one process had run the micro-batches in order.

In training mode a BatchNorm layer normalizes with its batch's statistics and folds them into its
running buffers. In deterministic mode the batch is the micro-batch (its statistics do not depend on the
world size, and SyncBatchNorm communicates nothing inside a step); the running buffers must not depend
on which rank ran which micro-batch either. So: the buffers are snapshotted when a step begins, each
training forward of a layer records (layer, count, mean, unbiased variance) for its micro-batch, and at the
end of the step every rank restores the snapshot, receives every micro-batch's records (an exact
exchange: gather_rows), and applies torch's update rule for micro-batch 0, 1, ..., K-1 in that order:
the same float operations on every rank, at every world size.

The statistics are the ones the layer's own kernel computes: for the forward, the layer's running
buffers are swapped for zeroed scratch ones and its momentum set to 1, so the kernel writes exactly the
batch mean and unbiased variance into them (0 * 0 + 1 * x = x), at no cost beyond the forward's own.
Computing them again beside the kernel (a var_mean per layer) cost resnet 15% of its step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

import torch
from torch import nn

from lockstep.errors import InternalError
from lockstep.runtime.collectives import gather_rows
from lockstep.torch_private import BatchNormBase

# Inside a deterministic step the micro-batch is the batch: SyncBatchNorm normalizes with its statistics and
# communicates nothing (ranks run different numbers of micro-batches; the statistics must not depend on them).
_MICRO_BATCH_STATISTICS: ContextVar[bool] = ContextVar("lockstep_syncbn_micro_batch", default=False)


@contextmanager
def micro_batch_statistics() -> Iterator[None]:
    """SyncBatchNorm layers use their own batch's statistics inside the block (deterministic mode)."""
    token = _MICRO_BATCH_STATISTICS.set(True)
    try:
        yield
    finally:
        _MICRO_BATCH_STATISTICS.reset(token)


def in_micro_batch_statistics() -> bool:
    """Inside `micro_batch_statistics()`: SyncBatchNorm (engine/syncbn.py) does not synchronize."""
    return _MICRO_BATCH_STATISTICS.get()


class RunningStats:
    """The tracked BatchNorm layers of a module, their snapshot, and the records of the step under way."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = [m for m in module.modules() if isinstance(m, BatchNormBase) and m.track_running_stats]
        self._index = {id(m): i for i, m in enumerate(self.layers)}
        self._snapshot: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._records: dict[int, list[torch.Tensor]] = {}
        self.ordinal: int | None = None  # the micro-batch whose forward is running; None outside a step
        self._scratch = [
            (torch.zeros_like(m.running_mean), torch.zeros_like(m.running_var))  # type: ignore[arg-type]
            for m in self.layers
        ]
        self._swapped: dict[int, tuple[Any, Any, Any, int]] = {}  # layer index -> buffers, momentum, count
        self._hooks = [m.register_forward_pre_hook(self._swap_in) for m in self.layers] + [
            m.register_forward_hook(self._record, always_call=True) for m in self.layers
        ]

    def begin(self) -> None:
        """Snapshot the buffers (a redo begins again from the same snapshot)."""
        self._records = {}
        if not self._snapshot:
            self._snapshot = [
                (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())  # type: ignore[union-attr]
                for m in self.layers
            ]

    def _swap_in(self, layer: BatchNormBase, args: tuple[Any, ...]) -> None:
        """Before a training forward inside a step: scratch buffers and momentum 1 catch the batch's statistics."""
        if self.ordinal is None or not layer.training or not args:
            return
        index = self._index[id(layer)]
        x = args[0]
        count = x.numel() // max(x.shape[1], 1) if x.dim() > 1 else 0
        self._swapped[index] = (layer.running_mean, layer.running_var, layer.momentum, count)
        mean, var = self._scratch[index]
        layer.running_mean, layer.running_var, layer.momentum = mean.zero_(), var.zero_(), 1.0

    def _record(self, layer: BatchNormBase, _args: tuple[Any, ...], _output: Any) -> None:
        """After the forward (even one that raised): buffers and momentum back; the statistics recorded."""
        index = self._index[id(layer)]
        swapped = self._swapped.pop(index, None)
        if swapped is None:
            return
        mean, var = cast(torch.Tensor, layer.running_mean), cast(torch.Tensor, layer.running_var)
        layer.running_mean, layer.running_var, layer.momentum, count = swapped
        with torch.no_grad():
            head = torch.tensor([float(index), float(count)], dtype=torch.float64, device=mean.device)
            row = torch.cat([head, mean.double(), var.double()])  # stays on the device: no sync per layer
        self._records.setdefault(_known_ordinal(self.ordinal), []).append(row)

    def finish(self, num_micro_batches: int, group: Any) -> None:
        """Restore the snapshot and replay every micro-batch's statistics in ordinal order (a collective)."""
        if not self.layers:
            return
        rows = {k: torch.cat(parts) for k, parts in self._records.items()}
        everything = gather_rows(rows, num_micro_batches, group)
        with torch.no_grad():
            everything = [row.cpu() for row in everything]
            for m, (mean, var, tracked) in zip(self.layers, self._snapshot):
                m.running_mean.copy_(mean)  # type: ignore[union-attr]
                m.running_var.copy_(var)  # type: ignore[union-attr]
                m.num_batches_tracked.copy_(tracked)  # type: ignore[union-attr]
            for row in everything:
                self._replay(row)
        self._snapshot, self._records = [], {}

    def _replay(self, row: torch.Tensor) -> None:
        offset = 0
        while offset < row.numel():
            layer = self.layers[int(row[offset])]
            count = float(row[offset + 1])
            channels = layer.num_features
            mean = row[offset + 2 : offset + 2 + channels]
            var = row[offset + 2 + channels : offset + 2 + 2 * channels]
            offset += 2 + 2 * channels
            _update(layer, mean, var, count)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _known_ordinal(ordinal: int | None) -> int:
    if ordinal is None:
        raise InternalError("running statistics: a forward hook ran outside the micro-batch it began in")
    return ordinal


def _update(layer: BatchNormBase, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
    """torch's rule for one training forward: count it, then running = (1 - f) * running + f * batch."""
    tracked, running_mean, running_var = layer.num_batches_tracked, layer.running_mean, layer.running_var
    if tracked is None or running_mean is None or running_var is None:
        return  # only layers with track_running_stats are recorded (RunningStats.layers)
    tracked.add_(1)
    factor = 1.0 / float(tracked.item()) if layer.momentum is None else float(layer.momentum)
    if count <= 1:
        return  # torch's BatchNorm refuses such a batch in training; nothing to fold in
    running_mean.mul_(1.0 - factor).add_(mean.to(running_mean), alpha=factor)
    running_var.mul_(1.0 - factor).add_(var.to(running_var), alpha=factor)
