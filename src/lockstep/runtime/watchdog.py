"""The hang watchdog: a thread per process that publishes this rank's progress and names a stall.

Each tick (a tenth of the hang timeout, 0.2-2 s) the thread writes a heartbeat to the c10d store
(`lockstep/watchdog/hb/<rank>`: step, phase, the collective the main thread waits in, its recent
collectives, the main thread's stack) and checks one key, `verdict`. It talks to the store over a
connection of its own, never through the process group, so a stuck collective cannot stop it.

When the main thread has waited in a collective longer than the timeout (or a collective raised), the
thread reads every rank's heartbeat and asks stall_verdict.judge who is to blame. The first rank to
write the verdict becomes the reporter; every rank then publishes its final state (all threads' stacks),
the reporter joins them into one report (JSON in the run directory under `lockstep run`, and the store),
every rank prints it (under `lockstep run`: one line; the launcher prints the report once) and the
process exits with STALL_EXIT_CODE. A rank whose collective raised re-raises its error instead, once
the report is out. Heartbeats that stop changing mark a rank as not responding; on the same host the
thread also says whether that process is stopped (SIGSTOP) or gone.

In live mode (runtime/live.py) a failed collective is not reported (the survivors re-form the group), and
neither is a stall whose culprits include ranks that stopped publishing heartbeats: the thread names
those dead on the store (`_live_evict`) and the survivors go on without them. Other stalls are reported.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lockstep.runtime import stall_verdict
from lockstep.runtime.progress import PROGRESS, CollectiveRecord, Progress, user_site
from lockstep.runtime.sigterm_guard import SigtermGuard

STALL_EXIT_CODE = 124  # like timeout(1): the job ran out of time waiting
SLOW_FACTOR = 5.0  # checkpoint/evaluate phases and the first steps may keep others waiting this much longer
_PREFIX = "lockstep/watchdog/"
_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")


def tick_for(timeout: float) -> float:
    return min(2.0, max(0.2, timeout / 10.0))


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
        live: bool = False,
    ) -> None:
        # Two connections: the thread's, and the main thread's for publish_issued (never shared).
        self.store, self.main_store = stores
        self.rank, self.world, self.timeout, self.report_dir = rank, world, timeout, report_dir
        # Live mode (runtime/live.py): a failed collective means a peer died and the survivors re-form the
        # group; only stalls are this thread's to report.
        self.live = live
        self.tick = tick_for(timeout)
        self.stale_after = max(2.0, 4 * self.tick)
        self.progress: Progress = PROGRESS
        self._beat = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._reported = threading.Event()  # the report is out: a failing main thread may raise now
        # rank -> (its beat, when that value was first read, whether it has changed since we looked)
        self._seen: dict[int, tuple[int, float, bool]] = {}
        self._marker = (-1, 0.0)  # (progress marker, since when unchanged): untracked waits
        self._failed_at = 0.0
        self._verdict: dict[str, Any] | None = None  # once set, this process ends (see _finish)
        self._judged_a_failure = False  # the verdict came from a failed collective: its error propagates
        self._evicted: set[int] = set()  # live mode: silent ranks this thread named dead
        self.host, self.pid = socket.gethostname(), os.getpid()
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
            self._thread.join(timeout=2 * self.tick + 1)
        self.guard.uninstall()
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
                self._publish()
                if self._has_verdict():
                    self._respond()
                    return
                if self._stalled():
                    verdict = self._judge()
                    if verdict is not None and self.live and _silent_culprits(verdict):
                        # Live mode: the survivors go on without the silent ranks. No report: the main
                        # thread re-forms the group (and stops this thread) as soon as it sees the change.
                        self._evict(verdict)
                        verdict = None
                    elif verdict is not None and _not_a_hang(verdict):
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
            pid=self.pid,
            beat=self._beat,
            t=now,
            exited=exited,
            untracked=self._untracked(frame),
            stack=_format_stack(frame),
        )
        if final:
            state["threads"] = _all_stacks()
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

    # ------------------------------------------------------------------ judging

    def _peers(self) -> dict[int, dict[str, Any]]:
        """Every rank's latest heartbeat, marked 'silent' (with 'liveness') where it stopped changing, or
        where this host can see that the process is stopped or gone; 'undecided' where it is too early
        to tell (its heartbeat has not changed since this rank started to look)."""
        keys = [f"{kind}/{r}" for kind in ("hb", "issued") for r in range(self.world) if r != self.rank]
        present = [k for k in keys if self.store.check([k])]
        values = dict(zip(present, self.store.multi_get(present))) if present else {}
        now = time.monotonic()
        states: dict[int, dict[str, Any]] = {}
        for rank in range(self.world):
            if rank == self.rank:
                continue
            raw = values.get(f"hb/{rank}")
            state: dict[str, Any] = json.loads(raw) if raw else {"rank": rank, "beat": -1, "phase": "?"}
            issued = values.get(f"issued/{rank}")
            if issued:
                _merge_issued(state, json.loads(issued))
            beat = int(state.get("beat", -1))
            seen = self._seen.get(rank)
            if seen is None:
                seen = self._seen[rank] = (beat, now, False)
            elif seen[0] != beat:
                seen = self._seen[rank] = (beat, now, True)
            unchanged = now - seen[1]
            gone = _gone(state, self.host)
            if not state.get("exited") and (gone or unchanged >= self.stale_after):
                state["silent"] = True
                state["liveness"] = gone or _liveness(state, unchanged)
            elif not state.get("exited") and not seen[2]:
                state["undecided"] = True
            states[rank] = state
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
        """Live mode: name each silent rank dead on the store, once; live.py's hook does the writing."""
        hook = _live_evict
        for rank in _silent_culprits(verdict):
            if hook is not None and rank not in self._evicted:
                self._evicted.add(rank)
                hook(int(rank), str(verdict["states"][rank].get("liveness") or "not responding"))

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
        self.store.set(f"final/{self.rank}", json.dumps(self._state(final=True)))
        report = self._wait_key("report", self.stale_after + 4 * self.tick + 5.0)
        self.store.set(f"ack/{self.rank}", "1")
        self._finish(json.loads(report) if report else None)

    def _report(self, verdict: dict[str, Any]) -> None:
        states = verdict.pop("states")
        self.store.set(f"final/{self.rank}", json.dumps(self._state(final=True)))
        expected = [r for r, s in states.items() if not s.get("silent") and not s.get("exited")]
        deadline = time.monotonic() + 2 * self.tick + 2.0
        finals: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline and len(finals) < len(expected):
            for r in expected:
                if r not in finals and self.store.check([f"final/{r}"]):
                    finals[r] = json.loads(self.store.get(f"final/{r}"))
            time.sleep(0.05)
        verdict["ranks"] = {str(r): finals.get(r, s) for r, s in sorted(states.items())}
        verdict["path"] = self._write_json(verdict)
        self.store.set("report", json.dumps(verdict))
        # Rank 0 may host the store (env:// without an agent): stay until the others have read the report.
        self._wait_keys([f"ack/{r}" for r in finals if r != self.rank], 2 * self.tick + 2.0)
        self._finish(verdict)

    def _write_json(self, report: dict[str, Any]) -> str | None:
        if not self.report_dir:
            return None
        path = os.path.join(self.report_dir, "hang_report.json")
        try:
            tmp = f"{path}.tmp{self.pid}"
            with open(tmp, "w") as fh:
                json.dump(report, fh, indent=1)
            os.replace(tmp, path)
        except OSError:
            return None
        return path

    def _wait_keys(self, keys: list[str], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while keys and time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.05)

    def _wait_key(self, key: str, seconds: float) -> bytes | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.store.check([key]):
                return bytes(self.store.get(key))
            time.sleep(0.05)
        return None

    def _finish(self, report: dict[str, Any] | None) -> None:
        if report is None:
            self._local_report("the reporting rank published no report")
            return
        if self.report_dir:
            where = report.get("path") or "the launcher's failure summary"
            sys.stderr.write(
                f"[rank {self.rank}] lockstep: hang detected: {report.get('summary')} ({where})\n"
            )
        else:
            sys.stderr.write(stall_verdict.format_report(report) + "\n")
        self._exit()

    def _local_report(self, why: str) -> None:
        """No store to agree through: say what this rank alone knows, then exit."""
        state = self._state(final=True)
        summary = f"rank {self.rank} could not reach the c10d store ({why})"
        if self._verdict is not None:
            summary = f"{self._verdict.get('summary')} [{summary} to read the full report]"
        else:
            summary += f" after waiting {self._waited():.1f} s; the rank that hosts it (rank 0 without a launcher) may be stopped or dead"
        report = {
            "kind": (self._verdict or {}).get("kind", "store unreachable"),
            "timeout": self.timeout,
            "summary": summary,
            "culprits": (self._verdict or {}).get("culprits", []),
            "ranks": {str(self.rank): state},
        }
        sys.stderr.write(stall_verdict.format_report(report) + "\n")
        self._exit()

    def _exit(self) -> None:
        self._reported.set()
        if self._judged_a_failure:
            return  # the main thread re-raises the collective's error (collective_failed)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(STALL_EXIT_CODE)


def _not_a_hang(verdict: dict[str, Any]) -> bool:
    """A collective failed because its peers left the group on purpose (their program ended, most often
    with an exception that the launcher reports with its traceback), and their collective sequences
    agree with this rank's: nothing hung."""
    states = verdict.get("states") or {}
    culprits = verdict.get("culprits") or []
    mine = states.get(verdict.get("detected_by"), {})
    return bool(
        mine.get("failed")
        and culprits
        and all(states.get(r, {}).get("exited") for r in culprits)
        and verdict.get("divergence") is None
    )


def _silent_culprits(verdict: dict[str, Any]) -> list[int]:
    """The culprits that stopped publishing heartbeats (stopped, hung hard, cut off): live mode evicts
    them. Others blamed beside them are usually their victims (a broadcast or ring that reached some ranks
    but not all parts their sequences by one); if a real bug remains, the next generation reports it."""
    states = verdict.get("states") or {}
    return [
        r
        for r in verdict.get("culprits") or []
        if stall_verdict.classify(states.get(r, {})) == stall_verdict.SILENT
    ]


def _format_stack(frame: Any, limit: int = 24) -> list[str]:
    """The innermost `limit` frames, outermost first, without reading source files (cheap every tick)."""
    out: list[str] = []
    while frame is not None and len(out) < limit:
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return out[::-1]


def _all_stacks() -> dict[str, list[str]]:
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        f"{names.get(ident, 'thread')} ({ident})": _format_stack(frame)
        for ident, frame in sys._current_frames().items()
    }


def _merge_issued(state: dict[str, Any], rec: dict[str, Any]) -> None:
    """A collective published as it was issued, newer than the heartbeat: the rank is (or died) in it."""
    recent = state.setdefault("recent", [])
    if any(r.get("group") == rec.get("group") and r.get("seq") == rec.get("seq") for r in recent):
        return
    recent.append(rec)
    if not state.get("exited"):
        state.update(waiting=rec, step=rec.get("step"), phase=rec.get("phase"), phase_for=0.0)


def _process_state(pid: int) -> str | None:
    """The state letter of a process on this host (R, S, D, T, Z...), None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _gone(state: dict[str, Any], my_host: str) -> str | None:
    """Why a rank on this host cannot answer (stopped or dead), None when it can or is elsewhere."""
    pid = state.get("pid")
    if not pid or state.get("host") != my_host or state.get("exited"):
        return None
    status = _process_state(int(pid))
    if status is None:
        return f"dead: its process (pid {pid}) no longer exists"
    if status in ("Z", "X"):
        return f"dead: its process (pid {pid}) has exited"
    if status in ("T", "t"):
        return f"stopped: its process (pid {pid}) is stopped (SIGSTOP or a debugger)"
    return None


def _liveness(state: dict[str, Any], unchanged: float) -> str:
    pid, host = state.get("pid"), state.get("host", "?")
    if state.get("beat", -1) < 0:
        return f"not responding: it never published a heartbeat in {unchanged:.1f} s"
    return f"not responding: no heartbeat for {unchanged:.1f} s (host {host}, pid {pid})"


# ---------------------------------------------------------------------- one per process

_current: Watchdog | None = None
_lock = threading.Lock()


def start(timeout: float, report_dir: str | None = None, *, live: bool = False) -> Watchdog | None:
    """Start this process's watchdog for the default group (no-op: world of 1, timeout 0, running).
    `live`: the job is in live mode, where a failed collective is recovered from, not reported."""
    global _current
    with _lock:
        if _current is not None or timeout <= 0 or not dist.is_initialized() or dist.get_world_size() < 2:
            return _current
        stores = _store(timeout), _store(timeout)
        if stores[0] is None or stores[1] is None:
            return None
        _current = Watchdog(stores, dist.get_rank(), dist.get_world_size(), timeout, report_dir, live=live)
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


@contextmanager
def tracked(
    op: str, tensors: Sequence[torch.Tensor], group: Any = None, *, publish: bool = False
) -> Iterator[CollectiveRecord]:
    """A synchronous collective of lockstep's (the small collectives, SyncBatchNorm, join, broadcasts):
    numbered, marked as waited on for the block, reported if it raises. `publish`: also written to the
    store at once, for collectives whose shapes the caller's data decides (runtime/collectives.py): a rank
    whose collective mismatches its peers' can be killed by gloo within milliseconds, before its next
    heartbeat. Not for the engine's per-step collectives, whose shapes the model fixes (a store round
    trip per step would cost more than all the rest of the tracking)."""
    rec = PROGRESS.issue(op, tensors, group)
    dog = _current
    if publish and dog is not None:
        dog.publish_issued(rec)
    with _waiting(dog, rec):
        yield rec


def wait_tracked(rec: CollectiveRecord, work: Any) -> Any:
    """Wait on an asynchronous collective issued earlier (an engine bucket): marked, reported if it raises."""
    with _waiting(_current, rec):
        return settle(work)


# Live mode (runtime/live.py) sets this: called every few milliseconds while a collective is waited on,
# it raises when the group's membership changed, so that no rank blocks in a group that lost a member.
_live_check: Callable[[], None] | None = None
_LIVE_CHECK_EVERY = 0.01


# Live mode also sets this: the watchdog thread calls it with a rank of the current group (and why) when
# that rank stopped publishing heartbeats while this one waits on it past the hang timeout.
_live_evict: Callable[[int, str], None] | None = None


def set_live_hooks(check: Callable[[], None] | None, evict: Callable[[int, str], None] | None) -> None:
    global _live_check, _live_evict
    _live_check, _live_evict = check, evict


def settle(work: Any) -> Any:
    """work.wait(), except in live mode, where the wait polls and gives up when a member is lost: gloo
    cannot abort a collective, and one that waits on a dead rank's peers would block for its timeout."""
    check = _live_check
    if check is None or work is None:
        return work.wait() if work is not None else None
    next_check = 0.0
    # A c10d Work (is_completed) or a torch Future (done): the engine's buckets wait on the latter.
    completed = work.is_completed if hasattr(work, "is_completed") else work.done
    while not completed():
        now = time.monotonic()
        if now >= next_check:
            check()
            next_check = now + _LIVE_CHECK_EVERY
        time.sleep(0.0002)
    return work.wait()


@contextmanager
def _waiting(dog: Watchdog | None, rec: CollectiveRecord) -> Iterator[None]:
    """The main thread waits on `rec`: marked for the watchdog, SIGTERM held meanwhile, reported if it raises."""
    guard = dog.guard if dog is not None else None
    if guard is not None:
        guard.enter()
    PROGRESS.begin_wait(rec)
    try:
        yield
        PROGRESS.end_wait()
    except (RuntimeError, dist.DistError) as exc:
        collective_failed(rec, exc)
        raise
    finally:
        if guard is not None:
            guard.leave()


def collective_failed(rec: CollectiveRecord, exc: BaseException) -> None:
    """A collective raised on the main thread: record it and let the watchdog report before it propagates."""
    PROGRESS.fail(rec, exc)
    dog = _current
    if dog is not None:
        dog.collective_failed()


def _store(timeout: float) -> Any:
    """A connection of the watchdog's own to the default group's store, under lockstep's prefix."""
    try:
        base = dist.distributed_c10d._get_default_store()
        own = base.clone()  # type: ignore[attr-defined]  # in torch, not in its stubs
        own.set_timeout(timedelta(seconds=max(5.0, min(timeout, 30.0))))
        return dist.PrefixStore(_PREFIX, own)
    except (RuntimeError, ValueError, AttributeError, NotImplementedError):
        return None  # a store that cannot open a second connection (FileStore, HashStore): no watchdog
