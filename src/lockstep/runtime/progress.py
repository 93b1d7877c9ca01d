"""Always-on progress tracking: what this process is doing now (step, phase, the collective it waits in).

Every collective that lockstep issues passes through `issue()` (engine buckets, the unused-parameter
agreement, join, SyncBatchNorm, broadcasts, the helpers of runtime/collectives.py): it gets a sequence
number per process group and a small record (op, shapes, dtypes, step, phase, call site, since when).
The main thread marks when it blocks on one (`begin_wait`/`end_wait`). The watchdog thread
(runtime/watchdog.py) reads this state and publishes it to the c10d store; nothing here talks to a peer,
so a collective costs a few attribute writes and one short walk up the Python stack.

One `Progress` per process (`PROGRESS`): like the logging module's root logger, it describes the process
and its main thread, which is what the watchdog reports on. Phases are coarse words a user recognises:
FORWARD, BACKWARD, OPTIMIZER, DATA (loading a batch), CHECKPOINT, EVALUATE, and BETWEEN_STEPS (after
a backward, before the next forward: optimizer, data loading or user code, when nothing more precise is
known). `phase("evaluate")` marks a span of the user's own; CHECKPOINT and EVALUATE may legitimately keep
other ranks waiting for a while (the watchdog allows them longer).

`Progress.clock` (runtime/phase_clock.py) times each phase of each step, waits apart, for the straggler
reports (runtime/straggler_reports.py): a perf_counter read per phase change and per wait.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lockstep.runtime.phase_clock import PhaseClock
from lockstep.torch_private import default_pg

STARTUP = "startup"
FORWARD = "forward"
BACKWARD = "backward"
BETWEEN_STEPS = "between steps"
OPTIMIZER = "optimizer"
DATA = "data loading"
CHECKPOINT = "checkpoint"
EVALUATE = "evaluate"
RECOVERY = "recovery"  # live mode: re-forming the group after a loss or to let replacements in
STATE_TRANSFER = "state transfer"  # live mode: a member sends a replacement the run's state
JOINING = "joining"  # live mode: a replacement from its admission until it trains (building, receiving)
# Phases in which one rank may keep the others waiting on purpose (rank 0 saving, a rank-0 evaluation, a
# replacement setting up after the members admitted it).
SLOW_PHASES = frozenset({CHECKPOINT, EVALUATE, JOINING})

RECENT = 64  # collectives kept per process: enough to see where two ranks' sequences parted
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_NOT_THE_CALLER = (_PACKAGE_DIR, _TORCH_DIR, os.path.abspath(contextlib.__file__))


class CollectiveRecord:
    """One collective as this rank issued it. Shapes are copied at issue time (tensors are not kept)."""

    __slots__ = ("seq", "op", "group", "shapes", "step", "phase", "site", "since", "work", "event", "done")

    def __init__(
        self, seq: int, op: str, group: str, shapes: list[str], step: int, phase: str, site: str
    ) -> None:
        self.seq, self.op, self.group, self.shapes = seq, op, group, shapes
        self.step, self.phase, self.site = step, phase, site
        self.since = time.time()
        self.work: Any = None  # the Work or Future, when the op is asynchronous: polled, never waited on
        self.event: Any = None  # a CUDA event recorded before the op was queued (nccl), else None
        self.done = False  # waited for (waits.wait_tracked): `work` is dropped then, and with it its tensors

    def state(self) -> str:
        """queued / in progress / done, as far as this process can tell without blocking."""
        if self.done:
            return "done"
        work = self.work
        try:
            if work is not None and (work.done() if hasattr(work, "done") else work.is_completed()):
                return "done"
            if self.event is not None and not self.event.query():
                return "queued (the GPU has not reached it yet)"
        except RuntimeError:
            return "failed"
        return "in progress"

    def describe(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "op": self.op,
            "group": self.group,
            "shapes": self.shapes,
            "step": self.step,
            "phase": self.phase,
            "site": self.site,
            "since": self.since,
            "state": self.state(),
        }


class Progress:
    """The main thread's progress; written by the training code, read by the watchdog thread."""

    def __init__(self) -> None:
        self.step = 0  # synced forwards so far (the engine's count; the trainer's step when it runs)
        self.steps_done = 0  # backwards finished: the first steps (compilation, bucket rebuild) are slow
        self.phase = STARTUP
        self.phase_since = time.time()
        self.pinned = 0  # inside phase(...): the engine's own phase changes do not override it
        self.marker = 0  # bumped on every change of phase and every finished wait: "still moving"
        self.waiting: CollectiveRecord | None = None  # the collective the main thread blocks on
        self.wait_since = 0.0
        self.recent: deque[CollectiveRecord] = deque(maxlen=RECENT)
        self.failed: str | None = None  # set when a collective raised: the watchdog reports at once
        self._seqs: dict[int, int] = {}
        self._group_names: dict[int, str] = {}
        self.main_thread = threading.main_thread().ident
        self.enabled = True  # off only to measure what tracking costs (benchmarks/hang_watchdog_overhead.py)
        self.clock = PhaseClock(STARTUP)  # time per phase per step, for the straggler reports
        self.account: Any = (
            None  # the run's goodput account (runtime/run_account.py sets it): told of each step
        )
        self.loop_driven = False  # a loop of lockstep's counts the steps (loop_step), not the synced forwards

    # ------------------------------------------------------------------ phases

    def set_phase(self, name: str) -> None:
        """The engine's (and trainer's) phase changes; ignored inside a user's `phase(...)` span."""
        if self.enabled and not self.pinned and self.phase != name:
            self.phase, self.phase_since = name, time.time()
            self.marker += 1
            if self.clock.enabled:
                self.clock.switch(name)

    def phase_starts_now(self) -> None:
        """Time the current phase from now: live mode's first group just formed, and what came before it
        (importing, waiting for the others to check in) kept nobody waiting in a collective."""
        self.phase_since = time.time()
        self.marker += 1

    def begin_step(self) -> None:
        """A synced forward starts a training step (unless a loop of lockstep's counts them: `loop_step`)."""
        if self.enabled and self.clock.enabled and not self.loop_driven:
            self.clock.close_step(self.step)
        self.step += 1
        self.set_phase(FORWARD)
        if self.account is not None and not self.loop_driven:
            self.account.step_began()

    def loop_step(self, step: int) -> None:
        """A loop of lockstep's (fit, LiveLoop) starts its optimizer step `step` (again, when it redoes it):
        the clock (straggler reports, the timeline) and the run's account count these steps from now on, not
        the engine's synced forwards (a micro-batched step has several). `loop_done` hands back."""
        self.loop_driven = True
        if self.enabled and self.clock.enabled:
            self.clock.close_step(step - 1)
        if self.account is not None:
            self.account.step_began()

    def loop_done(self) -> None:
        """The loop ended: synced forwards count as steps again (another program in this process)."""
        self.loop_driven = False

    def end_step(self) -> None:
        """The step's backward finished (its gradients are reduced)."""
        self.steps_done += 1
        self.set_phase(BETWEEN_STEPS)
        if self.account is not None:
            self.account.step_ended()

    def mark(self, name: str, *, kind: str, **args: Any) -> None:
        """An event (a fault, a replacement, a straggler) on this process's timeline, when one records
        (runtime/timeline/ attaches to the clock); safe from any thread."""
        timeline = self.clock.timeline
        if timeline is not None:
            timeline.mark(name, kind=kind, **args)

    # ------------------------------------------------------------------ collectives

    def issue(self, op: str, tensors: Sequence[torch.Tensor], group: Any = None) -> CollectiveRecord:
        """Stamp the next sequence number of `group` on a collective about to be issued; return its record."""
        if not self.enabled:
            return _UNTRACKED
        pg = group if group is not None else default_pg()  # dist.group.WORLD, without its property
        key = id(pg)
        seq = self._seqs[key] = self._seqs.get(key, 0) + 1
        name = self._group_names.get(key)
        if name is None:
            name = self._group_names[key] = _group_name(pg)
        rec = CollectiveRecord(seq, op, name, _shapes(tensors), self.step, self.phase, call_site())
        if tensors and tensors[0].is_cuda:
            rec.event = torch.cuda.Event()
            rec.event.record()
        self.recent.append(rec)
        return rec

    def begin_wait(self, rec: CollectiveRecord) -> None:
        self.waiting, self.wait_since = rec, time.time()
        if self.clock.enabled:
            self.clock.begin_wait(rec.op)

    def end_wait(self) -> None:
        self.waiting = None
        self.marker += 1
        if self.clock.enabled:
            self.clock.end_wait()

    def fail(self, rec: CollectiveRecord, exc: BaseException) -> None:
        """A collective raised on this rank: remember why (the watchdog reports what it can)."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.failed = f"{rec.op} #{rec.seq} raised {type(exc).__name__}: {first}"
        self.waiting = rec

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """A JSON-ready view for the watchdog (read from another thread: copies first, then formats)."""
        now = time.time() if now is None else now
        waiting = self.waiting
        return {
            "step": self.step,
            "steps_done": self.steps_done,
            "phase": self.phase,
            "phase_for": round(now - self.phase_since, 3),
            "marker": self.marker,
            "waiting": waiting.describe() if waiting is not None else None,
            "waiting_for": round(now - self.wait_since, 3) if waiting is not None else None,
            "failed": self.failed,
            "recent": [r.describe() for r in list(self.recent)],
        }


PROGRESS = Progress()
_UNTRACKED = CollectiveRecord(0, "untracked", "", [], 0, STARTUP, "")  # what issue() returns when disabled


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a span of the program: `with lockstep.phase("evaluate"): ...`.

    The hang watchdog reports it, and it allows CHECKPOINT and EVALUATE ("checkpoint", "evaluate") to keep
    the other ranks waiting longer than the hang timeout (a rank-0 save or evaluation is not a hang). The
    straggler reports time it under `name`.
    """
    prog = PROGRESS
    saved = prog.phase, prog.phase_since
    prog.pinned += 1
    prog.phase, prog.phase_since = name, time.time()
    prog.marker += 1
    clock = prog.clock
    if clock.enabled:
        clock.switch(name)
    try:
        yield
    finally:
        prog.pinned -= 1
        prog.phase, prog.phase_since = saved[0], time.time()
        prog.marker += 1
        if clock.enabled:
            clock.switch(saved[0])


def call_site() -> str:
    """The innermost frame outside lockstep and torch: the user's line that led to this collective."""
    return user_site(sys._getframe(2))


def user_site(frame: Any) -> str:
    """'FILE:LINE in FUNC' of the innermost frame from `frame` outward that is neither lockstep's nor
    torch's (nor contextlib's), '?' when there is none."""
    library = _MEMO.library
    while frame is not None:
        code = frame.f_code
        # Keyed by id (a code object's own hash walks its bytecode); the entry holds the code object, so
        # its id cannot be reused while the entry lives.
        entry = library.get(id(code))
        if entry is None or entry[0] is not code:  # once per code object: a dict lookup per frame after that
            if len(library) >= 8192:  # bounded: a program that makes code at run time cannot grow it forever
                library.clear()
            entry = library[id(code)] = (code, code.co_filename.startswith(_NOT_THE_CALLER))
        if not entry[1]:
            return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return "?"


class _Memo:
    """What call sites and shapes cost to work out, once: caches of pure functions, not state."""

    def __init__(self) -> None:
        # id(code object) -> (the code object, whether it is lockstep's, torch's or contextlib's)
        self.library: dict[int, tuple[Any, bool]] = {}
        self.shapes: dict[tuple[Any, ...], str] = {}  # (dtype, shape, sparse) -> its text


_MEMO = _Memo()


def _shapes(tensors: Sequence[torch.Tensor]) -> list[str]:
    out = []
    for t in tensors[:4]:
        key = (t.dtype, t.shape, t.is_sparse)
        text = _MEMO.shapes.get(key)
        if text is None:
            text = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}{'(sparse)' if t.is_sparse else ''}"
            if len(_MEMO.shapes) < 4096:
                _MEMO.shapes[key] = text
        out.append(text)
    if len(tensors) > 4:
        out.append(f"... {len(tensors) - 4} more")
    return out


def _group_name(pg: Any) -> str:
    if pg is None or pg is dist.group.WORLD:
        return "world"
    try:
        ranks = dist.get_process_group_ranks(pg)
    except (RuntimeError, ValueError):
        return "group"
    return f"ranks {ranks}"
