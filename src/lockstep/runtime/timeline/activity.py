"""The timeline's whole-run records, bounded: coarse activity spans and the marks.

The ring of recorder.py keeps a run's recent steps phase by phase; what a run did over hours is
kept here, coarsely: consecutive time in the training phases (data loading, forward, backward, between
steps, optimizer, a user's own phases) as one "training" span, each span of checkpointing, evaluating,
recovering, transferring state, joining or starting up as itself. A span is added only when the activity
changes, so a run that only trains holds one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TRAINING = "training"
# Phases that are an activity of their own (progress.py's names); any other phase is training.
ACTIVITIES = (TRAINING, "startup", "checkpoint", "evaluate", "recovery", "state transfer", "joining")
_IDS = {name: i for i, name in enumerate(ACTIVITIES)}
MAX_SPANS = 20000  # past that, the oldest half is merged two by two
MAX_MARKS, FIRST_MARKS = 2000, 1000  # past that, the oldest mark after the first 1000 goes


class ActivitySpans:
    """Where each activity began (perf_counter seconds); written by the main thread."""

    __slots__ = ("current", "kinds", "starts")

    def __init__(self) -> None:
        self.current = -2  # no activity yet (-1 is the timeline's "not looked up")
        self.starts: list[float] = []
        self.kinds: list[int] = []

    @staticmethod
    def activity_of(phase: str) -> int:
        return _IDS.get(phase, 0)

    def switch(self, now: float, kind: int) -> None:
        if kind == self.current:
            return
        self.current = kind
        self.starts.append(now)
        self.kinds.append(kind)
        if len(self.starts) > MAX_SPANS:
            self._merge_oldest()

    def _merge_oldest(self) -> None:
        """Halve the oldest half: each pair of spans becomes one, of the longer one's activity."""
        half = len(self.starts) // 2 & ~1
        starts: list[float] = []
        kinds: list[int] = []
        for k in range(0, half, 2):
            first, second = self.starts[k + 1] - self.starts[k], self.starts[k + 2] - self.starts[k + 1]
            kind = self.kinds[k] if first >= second else self.kinds[k + 1]
            if not kinds or kinds[-1] != kind:
                starts.append(self.starts[k])
                kinds.append(kind)
        if kinds[-1] == self.kinds[half]:  # the seam: equal neighbours are one span
            del self.starts[half], self.kinds[half]
        self.starts[:half], self.kinds[:half] = starts, kinds

    def as_list(self, us: Callable[[float], int], now: float) -> list[list[Any]]:
        """[[start us, end us, activity], ...]; the last span ends now."""
        ends = self.starts[1:] + [now]
        return [[us(s), us(e), ACTIVITIES[k]] for s, e, k in zip(self.starts, ends, self.kinds)]


class Marks:
    """Every mark up to MAX_MARKS, then the first FIRST_MARKS and the latest ones."""

    __slots__ = ("dropped", "kept")

    def __init__(self) -> None:
        self.kept: list[dict[str, Any]] = []
        self.dropped = 0

    def add(self, mark: dict[str, Any]) -> None:
        if len(self.kept) >= MAX_MARKS:
            del self.kept[FIRST_MARKS]
            self.dropped += 1
        self.kept.append(mark)
