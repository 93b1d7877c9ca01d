"""Dropping a straggler in live mode (`lockstep run --min-world M --evict-stragglers FACTOR`).

Rank 0's watchdog thread judges the ranks' busy time each tick (runtime/straggler_reports.py's `assess`:
each rank against the reference rank, the lower median, over the last WINDOW steps of both). A rank whose
busy time is at least FACTOR times the reference's, and more than the reports' minimum excess per step, in
`confirm` judgements in a row (each on a window with new steps) is evicted through the membership, exactly
as a rank that stopped answering is: `dead/<member>` says why ("evicted by the survivors (a straggler:
...)"), the launcher kills the process, and the others re-form the group and redo the step in progress
(docs/live.md). Nothing is lost: the step is redone over the survivors; in deterministic mode the run ends
with the bits of a fault-free run at the smaller world.

Two guards: a rank is evicted only while the world stays at least `--min-world` without it (otherwise the
survivors could not go on; the line says so, once), and at most one rank per generation (after an eviction
the world is re-formed and a new watchdog judges the new ranks from fresh windows: two ranks slowed by one
cause are not both dropped on one stale judgement).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lockstep.runtime.env.topology import evict_stragglers_from_env
from lockstep.runtime.straggler_reports import Assessment, StragglerPolicy, reference_name


class Evicts(Protocol):
    """What eviction needs of live mode's membership (runtime/membership/group.py's LiveGroup)."""

    min_world: int

    def evict(self, rank: int, why: str) -> None: ...


@dataclass
class StragglerEviction:
    """Rank 0's eviction of stragglers in one generation; `consider` returns the lines to print."""

    factor: float  # busy time at least this many times the reference rank's ...
    world: int
    min_world: int
    evict: Callable[[int, str], None]  # the membership's evict(rank, why): from the watchdog thread
    policy: StragglerPolicy
    evicted: int | None = None  # the rank evicted in this generation (at most one)
    _streak: dict[int, int] | None = None
    _refused: bool = False  # the "not evicted: below --min-world" line was printed

    def consider(self, assessments: dict[int, Assessment]) -> list[str]:
        if self.evicted is not None:
            return []
        streak = self._streak if self._streak is not None else {}
        self._streak = {r: streak.get(r, 0) + 1 for r, a in assessments.items() if self._too_slow(a)}
        due = [a for r, a in sorted(assessments.items()) if self._streak.get(r, 0) >= self.policy.confirm]
        if not due:
            return []
        worst = max(due, key=lambda a: a.factor)
        if self.world - 1 < self.min_world:
            if self._refused:
                return []
            self._refused = True
            return [
                f"rank {worst.rank} is {worst.factor:.1f}x {reference_name(self.world)} busy time, over "
                f"--evict-stragglers {self.factor:g}, but is not evicted: {self.world - 1} ranks would remain, "
                f"fewer than --min-world {self.min_world}"
            ]
        self.evicted = worst.rank
        why = self.why(worst)
        self.evict(worst.rank, why)
        return [f"evicting rank {worst.rank}: {why}"]

    def _too_slow(self, a: Assessment) -> bool:
        return a.factor >= self.factor and a.excess_ms >= self.policy.min_excess_ms

    def why(self, a: Assessment) -> str:
        return (
            f"a straggler: {a.factor:.1f}x {reference_name(self.world)} busy time (rank {a.reference}) over "
            f"steps {a.first_step}-{a.last_step}, +{a.phase_excess_ms:.1f} ms/step in {a.phase}; "
            f"--evict-stragglers {self.factor:g}"
        )


def eviction_for(rank: int, world: int, membership: Evicts | None) -> StragglerEviction | None:
    """Rank 0's eviction when the job is in live mode and `--evict-stragglers` is set, else None."""
    if membership is None or rank != 0:
        return None
    factor = evict_stragglers_from_env(os.environ)
    if factor is None:
        return None
    return StragglerEviction(factor, world, membership.min_world, membership.evict, StragglerPolicy())
