"""Straggler reports: name a rank that is persistently slower than the others, by how much and in which phase.

What is published: each rank's watchdog thread (runtime/watchdog.py), once per tick, writes the summary of
its last WINDOW steps (runtime/phase_clock.py: medians of step time, busy time and busy time per phase, in
ms) to the c10d store under `lockstep/watchdog/phases/<rank>`, next to its heartbeat, over the thread's own
connection. No collective is added: rank 0's watchdog thread reads every rank's summary (one multi_get per
tick) and judges.

The rule (`assess`, pure): a rank's busy time per step is its step time minus the time it waited in
collectives; a rank that waits for a slow peer is not busy meanwhile, so busy time points at the rank that
makes the others wait. The reference is the lower median rank: of the ranks sorted by busy time, the
((n-1)//2)-th (with 2 ranks, the faster one; with 3, the middle one). It is a real rank, so its phases can
be compared phase by phase, and a slow rank cannot be its own reference unless half of the ranks or more are
slow (then there is no single straggler to name). A rank becomes a straggler when its busy time is at least
`factor` times the reference's AND at least `min_excess_ms` more per step (the relative threshold ignores
small steps' jitter, the absolute one small relative noise on big steps); it stays one until it drops below
`leave_factor` or half the absolute excess (no flapping at the threshold). Each summary is a median over
WINDOW steps, so a spike shorter than half the window moves nothing, and a rank is named only when
`confirm` judgements in a row (one per tick with new steps) find it slow: a burst of CPU contention on a
shared machine that slows one rank for a moment is not a straggler. The phase named is the one with the
largest per-step busy-time excess over the reference rank.

The output: rank 0 prints one line to stderr (`[rank 0/W] WARNING lockstep.stragglers: ...`) when a rank
becomes a straggler, when its phase changes and when it is no longer one, and keeps a `StragglerReport` per
episode. `stragglers()` returns them (rank 0; other ranks return an empty list): what fit's summary.json
and metrics record.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from lockstep.runtime.phase_clock import WINDOW, PhaseClock
from lockstep.runtime.progress import PROGRESS

KEY = "phases/{rank}"  # under the watchdog's prefix, next to its hb/<rank>


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank counts as a straggler (see the module's docstring for the rule)."""

    factor: float = 1.2  # busy time at least this many times the reference rank's ...
    min_excess_ms: float = 5.0  # ... and at least this much more per step
    leave_factor: float = 1.1  # a straggler stays one until below this factor or half the excess
    confirm: int = 2  # judgements in a row (each on a window with new steps) before a rank is named


@dataclass(frozen=True)
class Assessment:
    """One rank against the reference rank, over the steps of both ranks' windows."""

    rank: int
    reference: int
    factor: float
    excess_ms: float
    phase: str  # the phase with the largest per-step busy excess over the reference
    phase_excess_ms: float
    first_step: int
    last_step: int


@dataclass
class StragglerReport:
    """One episode: `rank` was a straggler from `first_step` to `last_step` (as far as rank 0 saw), mostly
    in `phase`; `factor` and `excess_ms` are the largest seen (busy time against the reference rank's)."""

    rank: int
    host: str
    factor: float
    phase: str
    first_step: int
    last_step: int
    excess_ms: float
    ongoing: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def reference_name(world: int) -> str:
    return "the faster rank's" if world == 2 else "the median rank's"


def assess(summaries: dict[int, dict[str, Any]]) -> dict[int, Assessment]:
    """Every rank but the reference, against the reference (the lower median rank by busy time). Ranks
    without a summary are left out; fewer than 2 ranks with one: nothing to compare."""
    ranks = sorted((s["busy_ms"], r) for r, s in summaries.items() if s)
    if len(ranks) < 2:
        return {}
    ref_busy, ref = ranks[(len(ranks) - 1) // 2]
    base = summaries[ref]
    out = {}
    for busy, rank in ranks:
        if rank == ref:
            continue
        own = summaries[rank]
        excess = {p: ms - base["phases"].get(p, 0.0) for p, ms in own["phases"].items()}
        phase = max(excess, key=lambda p: excess[p]) if excess else "?"
        out[rank] = Assessment(
            rank=rank,
            reference=ref,
            factor=busy / ref_busy if ref_busy > 0 else float("inf"),
            excess_ms=busy - ref_busy,
            phase=phase,
            phase_excess_ms=excess.get(phase, 0.0),
            first_step=min(own["first"], base["first"]),
            last_step=max(own["last"], base["last"]),
        )
    return out


def is_straggler(a: Assessment, policy: StragglerPolicy, *, already: bool) -> bool:
    if already:
        return a.factor >= policy.leave_factor and a.excess_ms >= policy.min_excess_ms / 2
    return a.factor >= policy.factor and a.excess_ms >= policy.min_excess_ms


class StragglerLog:
    """The reports and which ranks are stragglers now; `update` returns the lines to print (pure)."""

    def __init__(self, world: int, policy: StragglerPolicy | None = None) -> None:
        self.world = world
        self.policy = policy or StragglerPolicy()
        self.reports: list[StragglerReport] = []
        self._now: dict[int, StragglerReport] = {}  # rank -> its ongoing episode
        self._streak: dict[int, tuple[int, int]] = {}  # rank -> (judgements in a row found slow, first step)
        self._lock = threading.Lock()  # written by the watchdog thread, read by the main thread

    def update(self, assessments: dict[int, Assessment], hosts: dict[int, str]) -> list[str]:
        lines = []
        with self._lock:
            for rank in set(self._streak) - set(assessments):
                del self._streak[rank]  # the reference now: compared with nobody
            for rank, a in sorted(assessments.items()):
                ongoing = self._now.get(rank)
                slow = is_straggler(a, self.policy, already=ongoing is not None)
                count, first = self._streak.pop(rank, (0, a.first_step))
                if slow:
                    self._streak[rank] = (count + 1, first)
                    if ongoing is None and count + 1 < self.policy.confirm:
                        continue
                    if ongoing is not None and ongoing.phase == a.phase:
                        ongoing.last_step = a.last_step
                        if a.factor > ongoing.factor:
                            ongoing.factor, ongoing.excess_ms = round(a.factor, 3), round(a.excess_ms, 3)
                        continue
                    if ongoing is not None:
                        ongoing.ongoing = False
                    report = StragglerReport(
                        rank,
                        hosts.get(rank, "?"),
                        round(a.factor, 3),
                        a.phase,
                        first,
                        a.last_step,
                        round(a.excess_ms, 3),
                    )
                    self.reports.append(report)
                    self._now[rank] = report
                    lines.append(self.line(a, report.host, first))
                    PROGRESS.mark(  # rank 0's watchdog thread: a mark is thread-safe
                        f"rank {rank} straggles: {a.factor:.1f}x in {a.phase}", kind="straggler", rank=rank
                    )
                elif ongoing is not None:
                    ongoing.ongoing = False
                    del self._now[rank]
                    lines.append(
                        f"rank {rank} (host {ongoing.host}) is no longer a straggler: {a.factor:.2f}x "
                        f"{reference_name(self.world)} busy time over steps {a.first_step}-{a.last_step}"
                    )
        return lines

    def line(self, a: Assessment, host: str, first_step: int) -> str:
        return (
            f"rank {a.rank} (host {host}) is a straggler: {a.factor:.1f}x {reference_name(self.world)} "
            f"busy time (rank {a.reference}) over steps {first_step}-{a.last_step}, "
            f"+{a.phase_excess_ms:.1f} ms/step in {a.phase}"
        )

    def snapshot(self) -> list[StragglerReport]:
        with self._lock:
            return [StragglerReport(**r.as_dict()) for r in self.reports]


class StragglerWatch:
    """The watchdog thread's part: publish this rank's summary each tick; on rank 0, read all and judge."""

    def __init__(
        self,
        rank: int,
        world: int,
        clock: PhaseClock,
        host: str,
        *,
        stale_after: float,
        eviction: Any = None,
    ) -> None:
        self.rank, self.world, self.clock, self.host = rank, world, clock, host
        self.log = StragglerLog(world)
        # Live mode with --evict-stragglers, on rank 0: runtime/straggler_eviction.py's StragglerEviction
        self.eviction = eviction
        self.stale_after = stale_after  # a peer's summary unchanged this long (s) is left out (stopped, gone)
        self._published = -1  # clock.closed at the last publication
        self._all_present = False
        self._changed: dict[int, tuple[int, float]] = {}  # rank -> (its summary's last step, seen since)
        if rank == 0:  # the rank that judges: stragglers() returns its reports
            _CURRENT.log = self.log

    def tick(self, store: Any) -> None:
        clock = self.clock
        if not clock.enabled or clock.closed == self._published:
            return  # no step closed since the last tick: nothing new to say or to judge
        self._published = clock.closed
        summary = clock.summary(WINDOW)
        if summary is None:
            return
        summary["host"] = self.host
        store.set(KEY.format(rank=self.rank), json.dumps(summary, separators=(",", ":")))
        if self.rank == 0:
            self.judge(store, summary)

    def judge(self, store: Any, own: dict[str, Any]) -> None:
        keys = [KEY.format(rank=r) for r in range(1, self.world)]
        if not self._all_present:
            self._all_present = bool(store.check(keys))  # multi_get would block on a missing key
            if not self._all_present:
                return
        summaries = {0: own}
        now = time.monotonic()
        for rank, raw in enumerate(store.multi_get(keys), start=1):
            summary = json.loads(raw)
            last, since = self._changed.get(rank, (-1, now))
            if last != summary["last"]:
                last, since = self._changed[rank] = summary["last"], now
            if now - since <= self.stale_after:
                summaries[rank] = summary
        hosts = {r: str(s.get("host", "?")) for r, s in summaries.items()}
        assessments = assess(summaries)
        lines = self.log.update(assessments, hosts)
        if self.eviction is not None:
            lines += self.eviction.consider(assessments)
        for line in lines:
            # Written as runtime/logging.py's loggers write a warning (that module imports process_group,
            # which imports the watchdog: using it here would close an import circle).
            print(f"[rank 0/{self.world}] WARNING lockstep.stragglers: {line}", file=sys.stderr, flush=True)


class _Current:
    """Rank 0's log of the current (or last) watchdog, for stragglers() on the main thread (an object's
    attribute: the process-wide state lives in objects, as runtime/progress.py's PROGRESS)."""

    log: StragglerLog | None = None


_CURRENT = _Current()


def stragglers() -> list[StragglerReport]:
    """The straggler reports of this job so far (copies): one per episode in which a rank was persistently
    slower than the reference rank, as rank 0's watchdog saw them. Only rank 0 judges: on other ranks, and
    without a watchdog (world of 1, hang timeout 0), an empty list. `report.as_dict()` is JSON-ready."""
    log = _CURRENT.log
    return log.snapshot() if log is not None else []
