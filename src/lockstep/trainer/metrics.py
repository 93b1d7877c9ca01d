"""Metrics buffered locally and reduced across ranks in one packed all-reduce that every rank runs."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lockstep.runtime import all_reduce_sum


class MetricBuffer:
    """Running sums of named metrics on this rank, weighted by sample counts.

    `add` costs no communication. `reduce` is a collective: every rank must call it at the same point
    (the trainer calls it on log steps, on all ranks), and it returns the global sample-weighted means.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._count = 0

    def add(self, values: Mapping[str, torch.Tensor | float], count: int) -> None:
        """Add per-batch mean values of a batch of `count` samples."""
        for name, value in values.items():
            value = value.detach().double().cpu() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            self._sums[name] = self._sums.get(name, torch.zeros((), dtype=torch.float64)) + value * count
        self._count += count

    def add_sums(self, sums: Mapping[str, float], count: int) -> None:
        """Add already-summed values (e.g. number of correct predictions) over `count` samples."""
        for name, value in sums.items():
            self._sums[name] = self._sums.get(name, torch.zeros((), dtype=torch.float64)) + float(value)
        self._count += count

    @property
    def count(self) -> int:
        return self._count

    def reduce(self, names: list[str]) -> tuple[dict[str, float], int]:
        """Global means of `names` (same list, same order on every rank) and the global sample count."""
        local = [float(self._sums.get(name, 0.0)) for name in names] + [float(self._count)]
        totals = all_reduce_sum(local)
        count = int(totals[-1])
        means = {name: (totals[i] / count if count else float("nan")) for i, name in enumerate(names)}
        self._sums.clear()
        self._count = 0
        return means, count
