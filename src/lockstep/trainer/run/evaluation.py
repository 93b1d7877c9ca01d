"""fit's evaluation: the evaluation set cut over the ranks without padded duplicates, its metrics reduced.

Every sample is evaluated on exactly one rank (data/eval_sampler.py), on the bare module: shards differ in
size, so nothing inside may communicate (a model sharded by FSDP2 all-gathers in every forward: there every
rank runs as many forwards as the busiest one, `EqualForwards`). In deterministic mode the set is cut into blocks of a fixed size,
assigned like micro-batches, and their sums are added in block order, so the metrics are the same bits at
any world size. The reduction at the end is a collective: every rank evaluates at the same point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sized
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lockstep.data import EvalSampler, MicroBatchSampler
from lockstep.engine.sharded import is_sharded
from lockstep.runtime.collectives import comm_device
from lockstep.runtime.env.topology import Topology
from lockstep.runtime.micro_batches import owned_micro_batches
from lockstep.runtime.progress import EVALUATE, phase
from lockstep.runtime.waits import tracked
from lockstep.trainer.reporting.metrics import MetricBuffer, OrderedMetrics, TrainMetrics
from lockstep.trainer.run.batches import batch_len, split_batch, to_device
from lockstep.trainer.run.device import autocast
from lockstep.trainer.settings.config import FitConfig

LossFn = Callable[[Any, Any], torch.Tensor]


class Evaluation:
    """Evaluating fit's model on `data` (None: the run has no evaluation set)."""

    def __init__(
        self,
        data: Dataset | None,
        config: FitConfig,
        metrics: TrainMetrics,
        loss_fn: LossFn,
        device: torch.device,
    ) -> None:
        self.data, self.config, self.metrics, self.loss_fn, self.device = (
            data,
            config,
            metrics,
            loss_fn,
            device,
        )
        self.loader: DataLoader | None = None
        self.topo: Topology | None = None

    @property
    def enabled(self) -> bool:
        return self.data is not None

    def reshard(self, topo: Topology) -> None:
        """This rank's shard of the evaluation set for the world of `topo` (again after a live change)."""
        self.topo = topo
        self.loader = _eval_loader(self.data, self.config, topo, pin_memory=self.device.type == "cuda")

    @torch.no_grad()
    @phase(EVALUATE)
    def run(self, module: nn.Module) -> dict[str, float]:
        """Evaluate `module` on every rank's shard; the global metrics (eval_loss, eval_samples, ...)."""
        module.eval()  # the bare module: eval shards are unequal and must not trigger any collective
        forwards = EqualForwards(module, self.loader)  # ... but a sharded one's forward all-gathers
        names = self.metrics.names("eval")
        sampler = self.loader.batch_sampler if self.loader is not None else None
        if isinstance(sampler, MicroBatchSampler) and self.topo is not None:
            blocks = OrderedMetrics()  # deterministic: blocks of a fixed size, summed in order
            blocks.num_rows = sampler.num_micro_batches
            owned = owned_micro_batches(sampler.num_micro_batches, self.topo.world_size, self.topo.rank)
            for ordinal, batch in zip(owned, self.loader or ()):
                blocks.add(ordinal, *self._sums(module, batch), names)
            forwards.finish(lambda batch: self._sums(module, batch))
            sums, total = blocks.reduce_sums(names)
        else:
            buffer = MetricBuffer()
            for batch in self.loader or ():
                inputs, targets = to_device(split_batch(batch), self.device)
                with autocast(self.config.precision, self.device):
                    outputs = module(inputs)
                    loss = self.loss_fn(outputs, targets)
                self.metrics.record(buffer, "eval", outputs, targets, loss, batch_len(targets))
            forwards.finish(lambda batch: self._sums(module, batch))
            sums, total = buffer.reduce_sums(names)  # collective: every rank is here
        module.train()
        means = {name: value / max(total, 1) for name, value in zip(names, sums)}
        result = {"eval_loss": means["eval_loss"], "eval_samples": total}
        if "eval_accuracy" in means:
            result["eval_accuracy"] = means["eval_accuracy"]
        return result

    def _sums(self, module: nn.Module, batch: Any) -> tuple[dict[str, torch.Tensor], int]:
        inputs, targets = to_device(split_batch(batch), self.device)
        with autocast(self.config.precision, self.device):
            outputs = module(inputs)
            loss = self.loss_fn(outputs, targets)
        return self.metrics.sums("eval", outputs, targets, loss, batch_len(targets))


def _eval_loader(
    eval_data: Dataset | None, config: FitConfig, topo: Topology, *, pin_memory: bool
) -> DataLoader | None:
    if eval_data is None:
        return None
    block = config.batch_size * 4
    if config.deterministic:  # blocks of a fixed size, assigned like micro-batches: one "step" of them all
        num_blocks = max(math.ceil(len(cast(Sized, eval_data)) / block), 1)
        sampler = MicroBatchSampler(
            cast(Sized, eval_data),
            block,
            num_blocks,
            num_replicas=topo.world_size,
            rank=topo.rank,
            shuffle=False,
            drop_last=False,
        )
        return DataLoader(
            eval_data, batch_sampler=sampler, num_workers=config.num_workers, pin_memory=pin_memory
        )
    return DataLoader(
        eval_data,
        batch_size=block,
        sampler=EvalSampler(cast(Sized, eval_data)),
        num_workers=config.num_workers,
        pin_memory=pin_memory,
    )


class EqualForwards:
    """A sharded model's forward all-gathers each FSDP unit, a collective: every rank then runs as many
    evaluation forwards as the rank with the most batches, the extra ones on a stand-in batch whose
    results are dropped. A replicated model's evaluation stays free of collectives."""

    def __init__(self, module: nn.Module, loader: DataLoader | None) -> None:
        self.loader = loader
        self.extra = 0
        if loader is None or not is_sharded(module):
            return
        mine = len(loader)
        most = torch.tensor([mine], dtype=torch.int64, device=comm_device(None))
        with tracked("allreduce max (evaluation batches)", (most,), None):
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
        self.extra = int(most.item()) - mine

    def finish(self, forward: Callable[[Any], Any]) -> None:
        """The extra forwards, after this rank's own batches (their results are not counted)."""
        if not self.extra or self.loader is None:
            return
        stand_in = next(iter(DataLoader(self.loader.dataset, batch_size=1)))
        for _ in range(self.extra):
            forward(stand_in)
