"""The hang watchdog: a thread per process that publishes this rank's progress and names a stall.

Each tick (a tenth of the hang timeout, 0.2-2 s) the thread writes a heartbeat to the c10d store
(`lockstep/watchdog/hb/<rank>`: step, phase, the collective the main thread waits in, its recent
collectives, the main thread's stack) and its straggler summary (runtime/straggler_reports.py:
`phases/<rank>`, judged on rank 0), and checks one key, `verdict`. It talks to the store over a connection
of its own, never through the process group, so a stuck collective cannot stop it.

When the main thread has waited in a collective longer than the timeout (or a collective raised), the
thread reads every rank's heartbeat and asks stall_verdict.judge who is to blame. The first rank to
write the verdict becomes the reporter; every rank then publishes its final state (all threads' stacks),
the reporter joins them into one report (JSON in the run directory under `lockstep run`, and the store),
every rank prints it (under `lockstep run`: one line; the launcher prints the report once) and the
process exits with STALL_EXIT_CODE. A rank whose collective raised re-raises its error instead, once
the report is out. Heartbeats that stop changing mark a rank as not responding; on the same host the
thread also says whether that process is stopped (SIGSTOP) or gone.

In live mode (runtime/membership/) neither a failed collective (the survivors re-form the group) nor a stall
whose culprits stopped their heartbeats is reported: the thread names them dead (`MembershipWatch.evict`),
and a peer /proc shows stopped at once (runtime/membership/stopped.py's rule). Other stalls are reported.

Around the thread: runtime/waits.py is how the main thread waits (tracked, reported, in live mode given
up on a lost member), runtime/peer_heartbeats.py reads the others' heartbeats, runtime/hang_report.py
joins the ranks' final states into the report, and runtime/process_inspection.py reads stacks and /proc.

The thread is a daemon (a hung main thread must still be able to exit), so it is stopped and joined at
exit, before the interpreter's teardown (`_stop_at_exit`: a daemon thread inside a store call then
aborts the process, exit -6).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lockstep.runtime import hang_report, stall_verdict
from lockstep.runtime.env.topology import hang_timeout_from_env, report_dir_from_env
from lockstep.runtime.membership.host import Watched as MembershipWatch  # what live mode hands in
from lockstep.runtime.peer_heartbeats import PeerHeartbeats
from lockstep.runtime.process_inspection import all_stacks, format_stack, proc_view
from lockstep.runtime.progress import PROGRESS, CollectiveRecord, Progress, user_site
from lockstep.runtime.sigterm_guard import SigtermGuard
from lockstep.runtime.straggler_eviction import eviction_for
from lockstep.runtime.straggler_reports import StragglerWatch
from lockstep.torch_private import default_store

STALL_EXIT_CODE = 124  # like timeout(1): the job ran out of time waiting
SLOW_FACTOR = 5.0  # checkpoint/evaluate phases and the first steps may keep others waiting this much longer
_PREFIX = "lockstep/watchdog/"
_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")


def tick_for(timeout: float) -> float:
    return min(2.0, max(0.2, timeout / 10.0))


def store_timeout_for(timeout: float) -> float:
    """The longest one store call of the thread may block (its connection's timeout), in seconds."""
    return max(5.0, min(timeout, 30.0))


class Watchdog:
    """One per process while a process group of more than one rank exists (see `start`)."""

    def __init__(
        self,
        stores: tuple[Any, Any],
        rank: int,
        world: int,
        timeout: float,
        report_dir: str | None,
        *,
        membership: MembershipWatch | None = None,
    ) -> None:
        # Two connections: the thread's, and the main thread's for publish_issued (never shared).
        self.store, self.main_store = stores
        self.rank, self.world, self.timeout, self.report_dir = rank, world, timeout, report_dir
        # Live mode: a failed collective is a dead peer (the survivors re-form); silent ranks are evicted.
        self.membership = membership
        self.live = membership is not None
        self.tick = tick_for(timeout)
        self.stale_after = max(2.0, 4 * self.tick)
        self.progress: Progress = PROGRESS
        self._beat = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._reported = threading.Event()  # the report is out: a failing main thread may raise now
        self._marker = (-1, 0.0)  # (progress marker, since when unchanged): untracked waits
        self._failed_at = 0.0
        self._verdict: dict[str, Any] | None = None  # once set, this process ends (see _finish)
        self._judged_a_failure = False  # the verdict came from a failed collective: its error propagates
        self._evicted: set[int] = set()  # live mode: silent ranks this thread named dead
        self.host, self.view, self.pid = socket.gethostname(), proc_view(), os.getpid()
        self.heartbeats = PeerHeartbeats(rank, world, self.host, self.stale_after)
        eviction = eviction_for(rank, world, membership)  # live mode with --evict-stragglers, on rank 0
        self.stragglers = StragglerWatch(
            rank, world, self.progress.clock, self.host, stale_after=self.stale_after, eviction=eviction
        )
        self._thread = threading.Thread(target=self._run, name="lockstep-watchdog", daemon=True)
        self.guard = SigtermGuard()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.guard.install()
        self._thread.start()

    def stop(self) -> None:
        """A clean exit: say so in the store (peers must not wait for this rank), then end the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # Long enough for a store call in flight to come back: a thread still inside one when the
            # interpreter tears down aborts the process (see the module's docstring).
            self._thread.join(timeout=2 * self.tick + store_timeout_for(self.timeout) + 1)
        self.guard.uninstall()
        if not dist.is_initialized():
            return  # the program destroyed the group itself: its peers watch it no more, its store may be gone
        try:
            self._publish(exited=True)
        except Exception:  # noqa: BLE001  the store may be gone already (rank 0 hosted it and left)
            pass

    def publish_issued(self, rec: CollectiveRecord) -> None:
        """From the main thread, over a connection of its own: the collective it is about to issue."""
        try:
            self.main_store.set(f"issued/{self.rank}", json.dumps(rec.describe()))
        except Exception:  # noqa: BLE001  best effort: the heartbeat still carries it a tick later
            pass

    def collective_failed(self) -> None:
        """Called by the main thread when a collective raised: report now, wait for it (bounded).

        A peer's death is usually why: the launcher then stops every worker with SIGTERM at once. The
        guard holds a SIGTERM back while a collective is waited on, this wait included, and the main
        thread delivers it right after (the launcher's SIGKILL still comes after its grace period, 5 s
        by default), so the report names the dead rank.
        """
        if not self._thread.is_alive() or self.live:
            return
        self._wake.set()
        self._reported.wait(timeout=self.stale_after + 4 * self.tick + 5.0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not dist.is_initialized():
                    return  # the program destroyed the group (torch's tests do): nothing is left to watch
                self._publish()
                if self._has_verdict():
                    self._respond()
                    return
                if self.live and self._waited() > 0:  # a peer /proc shows lost: no timeout to wait out
                    for rank, why in self.heartbeats.surely_lost(self.store).items():
                        self._evict_one(rank, why)
                if self._stalled():
                    verdict = self._judge()
                    if verdict is not None and self.live and stall_verdict.evictable_culprits(verdict):
                        # Live mode: the survivors go on without the silent ranks. No report: the main
                        # thread re-forms the group (and stops this thread) as soon as it sees the change.
                        self._evict(verdict)
                        verdict = None
                    elif verdict is not None and stall_verdict.not_a_hang(verdict):
                        self._reported.set()  # the failing collective's error is all there is to say
                        return
                    if verdict is not None and self._claim(verdict):
                        self._report(verdict)
                        return
                self._wake.wait(self.tick)
                self._wake.clear()
        except Exception:  # noqa: BLE001  a broken store must never break training: stop watching
            if self._verdict is not None or self.progress.failed or self._waited() > self.timeout:
                self._local_report(traceback.format_exc(limit=1).strip().splitlines()[-1])

    def _waited(self) -> float:
        prog = self.progress
        if prog.waiting is not None:
            return time.time() - prog.wait_since
        marker, since = self._marker
        return time.time() - since if self._untracked() and marker == prog.marker else 0.0

    def _stalled(self) -> bool:
        """Worth looking at the others: a failed collective, or a wait past half the timeout."""
        if self.progress.failed and not self._failed_at:
            self._failed_at = time.monotonic()
        return (bool(self.progress.failed) and not self.live) or self._waited() > self.timeout / 2

    # ------------------------------------------------------------------ what this rank publishes

    def _state(self, *, final: bool = False, exited: bool = False) -> dict[str, Any]:
        now = time.time()
        state = self.progress.snapshot(now)
        frame = sys._current_frames().get(self.progress.main_thread or 0)
        state.update(
            rank=self.rank,
            host=self.host,
            view=self.view,
            pid=self.pid,
            beat=self._beat,
            t=now,
            exited=exited,
            untracked=self._untracked(frame),
            stack=format_stack(frame),
        )
        if final:
            state["threads"] = all_stacks()
        return state

    def _untracked(self, frame: Any = None) -> str | None:
        """'torch.distributed.X called at SITE' when the main thread is inside torch's c10d Python API."""
        frame = frame or sys._current_frames().get(self.progress.main_thread or 0)
        if frame is None or not frame.f_code.co_filename.endswith(_C10D_FILES):
            return None
        return f"torch.distributed.{frame.f_code.co_name} called at {user_site(frame)}"

    def _publish(self, *, exited: bool = False) -> None:
        self._beat += 1
        prog = self.progress
        if self._marker[0] != prog.marker:
            self._marker = (prog.marker, time.time())
        self.store.set(f"hb/{self.rank}", json.dumps(self._state(exited=exited)))
        if not exited:
            self.stragglers.tick(self.store)

    # ------------------------------------------------------------------ judging

    def _peers(self) -> dict[int, dict[str, Any]]:
        """Every rank's latest state: the others' heartbeats (runtime/peer_heartbeats.py) and this rank's."""
        states = self.heartbeats.read(self.store)
        states[self.rank] = self._state()
        return dict(sorted(states.items()))

    def _judge(self) -> dict[str, Any] | None:
        states = self._peers()
        if self._waited() <= self.timeout and not self.progress.failed:
            return None  # only looking so far (from half the timeout on): liveness needs a history
        undecided = any(s.get("undecided") for s in states.values())
        failed_long_enough = self.progress.failed and time.monotonic() - self._failed_at >= self.stale_after
        if undecided and not failed_long_enough:
            return None
        verdict = stall_verdict.judge(self.rank, states, self.timeout, SLOW_FACTOR)
        if verdict is not None:
            verdict["states"] = states
        return verdict

    def _evict(self, verdict: dict[str, Any]) -> None:
        """Live mode: name each evictable rank dead (silent, or too slow to join), once, in the membership."""
        for rank in stall_verdict.evictable_culprits(verdict):
            why = verdict["states"][rank].get("liveness") or verdict["why"].get(str(rank))
            self._evict_one(int(rank), str(why or "not responding"))

    def _evict_one(self, rank: int, why: str) -> None:
        if self.membership is not None and rank not in self._evicted:
            self._evicted.add(rank)
            self.membership.evict(rank, why)

    def _claim(self, verdict: dict[str, Any]) -> bool:
        """Become the reporter unless another rank already is (then answer it)."""
        self._judged_a_failure = bool(self.progress.failed)
        compact = {k: v for k, v in verdict.items() if k != "states"}
        written = self.store.compare_set("verdict", "", json.dumps(compact))
        self._verdict = json.loads(written)
        if self._verdict.get("detected_by") == self.rank:
            return True
        self._respond()
        return False

    def _has_verdict(self) -> bool:
        return bool(self.store.check(["verdict"]))

    # ------------------------------------------------------------------ the report

    def _respond(self) -> None:
        """Another rank judged: publish this rank's final state, print the report, exit."""
        if self._verdict is None:
            self._judged_a_failure = bool(self.progress.failed)
            self._verdict = json.loads(self.store.get("verdict"))
        wait_s = self.stale_after + 4 * self.tick + 5.0
        self._finish(hang_report.respond(self.store, self.rank, self._state(final=True), wait_s))

    def _report(self, verdict: dict[str, Any]) -> None:
        path = os.path.join(self.report_dir, "hang_report.json") if self.report_dir else None
        final = self._state(final=True)
        wait_s = 2 * self.tick + 2.0
        self._finish(
            hang_report.collect(self.store, self.rank, verdict, final, wait_s=wait_s, report_path=path)
        )

    def _finish(self, report: dict[str, Any] | None) -> None:
        if report is None:
            self._local_report("the reporting rank published no report")
            return
        hang_report.print_report(self.rank, report, self.report_dir)
        self._exit()

    def _local_report(self, why: str) -> None:
        """No store to agree through: say what this rank alone knows, then exit."""
        state = self._state(final=True)
        hang_report.print_local_report(self.rank, why, state, self._verdict, self._waited(), self.timeout)
        self._exit()

    def _exit(self) -> None:
        self._reported.set()
        if self._judged_a_failure:
            return  # the main thread re-raises the collective's error (collective_failed)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(STALL_EXIT_CODE)


# ---------------------------------------------------------------------- one per process

_current: Watchdog | None = None
_lock = threading.Lock()
_hang_timeout: list[float] = []  # init(hang_timeout=...) of this process, if it gave one


def set_hang_timeout(seconds: float) -> None:
    """This process's hang timeout from now on (lockstep.init(hang_timeout=...))."""
    _hang_timeout[:] = [float(seconds)]


def hang_timeout_setting() -> float:
    """The hang watchdog's timeout for this process: init(hang_timeout=...), else LOCKSTEP_HANG_TIMEOUT,
    else 300 s (0: off)."""
    return _hang_timeout[-1] if _hang_timeout else hang_timeout_from_env(os.environ)


def start(
    timeout: float, report_dir: str | None = None, *, membership: MembershipWatch | None = None
) -> Watchdog | None:
    """Start this process's watchdog for the default group (no-op: world of 1, timeout 0, running).
    `membership`: the job is in live mode, where a failed collective is recovered from, not reported,
    and a silent rank is evicted through it. `report_dir` None: `lockstep run`'s, if any (a program that
    formed its own group, as the frameworks do, still reports where the launcher reads)."""
    global _current
    report_dir = report_dir or report_dir_from_env(os.environ)
    with _lock:
        if _current is not None or timeout <= 0 or not dist.is_initialized() or dist.get_world_size() < 2:
            return _current
        stores = _store(timeout), _store(timeout)
        if stores[0] is None or stores[1] is None:
            return None
        _current = Watchdog(
            stores, dist.get_rank(), dist.get_world_size(), timeout, report_dir, membership=membership
        )
        _current.start()
        return _current


def stop() -> None:
    """End this process's watchdog (a clean exit, published so that no peer waits for this rank)."""
    global _current
    with _lock:
        dog, _current = _current, None
    if dog is not None:
        dog.stop()


def current() -> Watchdog | None:
    return _current


def _stop_at_exit() -> None:
    """Stop this process's watchdog at exit, before the interpreter's teardown: a daemon thread that comes
    back from a store call once teardown began is ended with pthread_exit(), whose unwinding meets
    pybind11's noexcept gil_scoped_release destructor and aborts the process ("terminate called without an
    active exception", exit -6). Nothing else stops it in a program that formed its own group (torch's
    tests, a framework) and never calls lockstep.shutdown(). A forked child leaves its parent's alone."""
    dog = _current
    if dog is not None and dog.pid == os.getpid():
        stop()


# Registered at import, not when a watchdog starts: the hook is a no-op without one, and no module state
# changes at start (the rank pool sees a changed module global as a worker not back in its first state).
atexit.register(_stop_at_exit)


def _store(timeout: float) -> Any:
    """A connection of the watchdog's own to the default group's store, under lockstep's prefix."""
    try:
        base = default_store()
        own = base.clone()  # type: ignore[attr-defined]  # in torch, not in its stubs
        own.set_timeout(timedelta(seconds=store_timeout_for(timeout)))
        return dist.PrefixStore(_PREFIX, own)
    except (RuntimeError, ValueError, AttributeError, NotImplementedError):
        return None  # a store that cannot open a second connection (FileStore, HashStore): no watchdog
