"""fit's metrics: summed on the device between log steps, reduced across ranks in one packed all-reduce.

`MetricBuffer` (float sums, the default) and `OrderedMetrics` (deterministic and live mode: one row per
micro-batch, summed in ordinal order) hold the sums; `TrainMetrics` knows what a task measures (the loss,
and the accuracy of a classifier) and holds the training rows pending until the next log.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lockstep.runtime import all_reduce_sum
from lockstep.runtime.collectives import gather_rows


class MetricBuffer:
    """Running sums of named metrics on this rank, weighted by sample counts, kept as device tensors.

    `add` and `add_sums` neither communicate nor copy to the host: a GPU run does not wait for the GPU on
    every micro-batch. `reduce` is a collective: every rank must call it at the same point (the trainer calls
    it on log steps and after evaluation, on all ranks); it copies the sums to the host once, all-reduces them
    in one packed call, and returns the global sample-weighted means.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0

    def add(self, means: Mapping[str, torch.Tensor | float], count: int) -> None:
        """Add per-batch mean values of a batch of `count` samples."""
        for name, value in means.items():
            self._accumulate(name, _as_float64(value) * count)
        self._count += count

    def add_sums(self, sums: Mapping[str, torch.Tensor | float], count: int) -> None:
        """Add already-summed values (e.g. the number of correct predictions) over `count` samples."""
        for name, value in sums.items():
            self._accumulate(name, _as_float64(value))
        self._count += count

    def _accumulate(self, name: str, value: torch.Tensor) -> None:
        # Out of place: the first value may share memory with the caller's tensor (a float64 loss detached).
        self._sums[name] = value if name not in self._sums else self._sums[name] + value

    @property
    def count(self) -> int:
        return self._count

    def reduce_sums(self, names: list[str]) -> tuple[list[float], int]:
        """Global sums of `names` (same list, same order on every rank) and the global sample count; resets."""
        totals = all_reduce_sum(self._local_sums(names) + [float(self._count)])
        self._sums.clear()
        self._count = 0
        return totals[:-1], int(totals[-1])

    def reduce(self, names: list[str]) -> tuple[dict[str, float], int]:
        """Global sample-weighted means of `names` (NaN when no rank saw a sample) and the global count."""
        sums, count = self.reduce_sums(names)
        return {name: (total / count if count else float("nan")) for name, total in zip(names, sums)}, count

    def _local_sums(self, names: list[str]) -> list[float]:
        """This rank's sums as floats, 0.0 for a metric never added: one device-to-host copy for all of them."""
        present = [self._sums[name] for name in names if name in self._sums]
        if not present:
            return [0.0] * len(names)
        device = present[0].device
        values = iter(torch.stack([value.to(device) for value in present]).tolist())
        return [next(values) if name in self._sums else 0.0 for name in names]


def _as_float64(value: torch.Tensor | float) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.tensor(float(value), dtype=torch.float64)


class OrderedMetrics:
    """Deterministic mode's metrics: one row per micro-batch (or evaluation block), summed in ordinal order.

    Which rank computed a row does not matter: rows travel through an exact exchange (gather_rows) and
    math.fsum adds them correctly rounded, so the means are the same bits at every world size. The loop
    says how many rows every rank expects (`num_rows`), which the rows held locally cannot tell.
    """

    def __init__(self) -> None:
        self._rows: dict[int, list[torch.Tensor]] = {}
        self.num_rows = 0  # rows expected since the last reduce, over all ranks

    def add(
        self, ordinal: int, sums: Mapping[str, torch.Tensor | float], count: int, names: list[str]
    ) -> None:
        """The row of micro-batch `ordinal`: its sample count and its sums of `names` (0 where absent)."""
        values = [_as_float64(sums.get(name, 0.0)).reshape(()) for name in names]
        self._rows[ordinal] = [torch.tensor(float(count), dtype=torch.float64), *[v.cpu() for v in values]]

    @property
    def count(self) -> int:
        return self.num_rows

    def packed(self) -> bytes:
        """The rows held here as float64 bytes, each [ordinal, count, sums...] (live mode keeps them on the store)."""
        rows = [
            torch.stack([torch.tensor(float(k), dtype=torch.float64), *v])
            for k, v in sorted(self._rows.items())
        ]
        return torch.cat(rows).numpy().tobytes() if rows else b""

    def merge(self, other: OrderedMetrics) -> None:
        """`other`'s rows (a step's, by ordinal) held here from now on."""
        self._rows.update(other._rows)

    def add_packed(self, data: bytes, names: list[str]) -> None:
        """Rows that `packed` gave (a lost member's): held here from now on."""
        if not data:
            return
        flat = torch.frombuffer(bytearray(data), dtype=torch.float64).reshape(-1, 2 + len(names))
        for row in flat:
            self._rows[int(row[0])] = list(row[1:].clone().unbind())

    def reduce_sums(self, names: list[str]) -> tuple[list[float], int]:
        """Global sums of `names` and the global sample count (a collective: every rank calls it); resets."""
        rows = {ordinal: torch.stack(values) for ordinal, values in self._rows.items()}
        everything = [row.tolist() for row in gather_rows(rows, self.num_rows)]
        self._rows, self.num_rows = {}, 0
        present = [row for row in everything if row]
        count = int(math.fsum(row[0] for row in present))
        return [math.fsum(row[1 + i] for row in present) for i in range(len(names))], count

    def reduce(self, names: list[str]) -> tuple[dict[str, float], int]:
        sums, count = self.reduce_sums(names)
        return {name: (total / count if count else float("nan")) for name, total in zip(names, sums)}, count


class TrainMetrics:
    """What fit measures for its task, and the training metrics pending until the next log."""

    def __init__(self, task: str, *, ordered: bool) -> None:
        self.task, self.ordered = task, ordered
        self.pending: MetricBuffer | OrderedMetrics = OrderedMetrics() if ordered else MetricBuffer()
        self.unlogged: list[
            tuple[int, int]
        ] = []  # live mode: (step, generation) committed since the last log

    def names(self, prefix: str) -> list[str]:
        return [f"{prefix}_loss"] + ([f"{prefix}_accuracy"] if self.task == "classification" else [])

    def sums(
        self, prefix: str, outputs: Any, targets: Any, loss: torch.Tensor, count: int
    ) -> tuple[dict[str, torch.Tensor], int]:
        """One micro-batch's (or evaluation block's) sums in float64, and its sample count."""
        sums = {f"{prefix}_loss": loss.detach().double() * count}
        if self.task == "classification":
            sums[f"{prefix}_accuracy"] = (outputs.argmax(dim=-1) == targets).sum().double()
        return sums, count

    def record(
        self, buffer: MetricBuffer, prefix: str, outputs: Any, targets: Any, loss: torch.Tensor, count: int
    ) -> None:
        """Add a batch's loss (and correct predictions) to `buffer` on the device: no copy to the host here."""
        buffer.add({f"{prefix}_loss": loss}, count)
        if self.task == "classification":
            buffer.add_sums({f"{prefix}_accuracy": (outputs.argmax(dim=-1) == targets).sum()}, 0)

    def drop_pending(self) -> None:
        """Forget the rows since the last log (live mode: a reduction that completed on some members only
        took theirs, so the interval cannot be had again on every member; the log skips it)."""
        self.pending = type(self.pending)()
        self.unlogged = []

    def state_dict(self) -> dict[str, Any]:
        rows = self.pending.num_rows if isinstance(self.pending, OrderedMetrics) else 0
        return {"rows": rows, "unlogged": self.unlogged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.pending, OrderedMetrics):
            self.pending.num_rows = int(state["rows"])
        self.unlogged = [(int(step), int(generation)) for step, generation in state["unlogged"]]
