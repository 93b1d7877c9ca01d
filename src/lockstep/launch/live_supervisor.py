"""Live mode's supervisor: the launcher's loop that watches its workers and tells the store what it sees.

How a worker ended is counted by launch/live_account.py's rule (STOPPED, FINISHED, NOT_NEEDED, FAULT,
ERROR); this loop acts on it:

- A FAULT while others run (killed by a signal, evicted, or exited non-zero without an exception record):
  the supervisor counts a change and writes `dead/<member>` = how it ended to the store at once
  (survivors that were not its neighbours learn it there), prints one line, and the others go on.
- An ERROR (exited non-zero with a Python exception recorded: an InternalError, the program's own
  exception, ...) ends the job: every other worker is stopped (SIGTERM, SIGKILL after the grace: they
  may be stuck), nothing is replaced. On one node the launcher then restarts the whole job while
  --max-restarts allows (launch/live_launch.py); on several nodes the error ends the job on every node
  (`ended` on the store), since live mode has no whole-job restart across nodes.
- Workers the launcher stops itself (Ctrl-C/SIGTERM, the job's end, an ERROR elsewhere) are neither:
  no line, no replacement.
- Fewer than --min-world workers left running, and the rest not finished: the job fails (one node).
- A worker that the survivors evicted (it stopped answering: SIGSTOP, a hard hang; they mark it dead on
  the store themselves) is killed, so that it cannot wake up into a group that went on without it.
- With `--max-restarts R`, each lost worker (while the job goes on, up to R in all, whole-job restarts
  included; a sharded run's replica group lost counts one, however many of its members end:
  live_account.py's `Replacements`) is replaced by a new process with the next member id and the lost
  one's RANK/LOCAL_RANK (its device). It queues on the store and the members admit it at a step boundary
  (runtime/membership/admission.py). Once only replacements that were never admitted still run, on every
  node, the supervisor writes `closed` and they exit 0 (not finishers).
- On several nodes, node 0's supervisor keeps the store up until every other node is done or silent
  (launch/node_heartbeat.py); a node that cannot reach the store for STORE_LOST_S stops its workers.

The store keys are named in runtime/membership/keys.py (the launchers' own `ended` here); docs/live.md
draws the protocol.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lockstep.launch.console_lines import goodput_line
from lockstep.launch.console_relay import Console
from lockstep.launch.failure_report import first_failure, format_failure
from lockstep.launch.live_account import Ending, Replacements, ending, error_summary, outcome
from lockstep.launch.live_workers import POLL_S, LiveWorker, exit_code, signal_all
from lockstep.launch.node_heartbeat import NodeHeartbeat
from lockstep.launch.spec import LaunchSpec
from lockstep.runtime.membership import keys

STORE_LOST_S = 10.0  # a node that could not reach the store this long stops its workers and leaves the job
EVICTIONS_READ_S = 1.0  # how often the dead marks of running workers are read when no change was counted
LOCK_WAIT_S = 10.0  # the main thread waits this long for a look in progress (a remote store call: 5 s)
JOB_ENDED = f"{keys.ROOT}ended"  # several nodes: a launcher saw a job-ending error; = what it was

# (member id, RANK, LOCAL_RANK, joiner) -> the started worker
StartWorker = Callable[[int, int, int, bool], LiveWorker]


@dataclass(frozen=True)
class NodeLayout:
    """Where this launcher stands in the job."""

    node: int
    nodes: int
    per_node: int
    host: str  # the store's address (node 0's)
    port: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


class LiveSupervisor:
    """The launcher's loop in live mode for one attempt of the job (see the module doc)."""

    def __init__(
        self,
        spec: LaunchSpec,
        layout: NodeLayout,
        workers: list[LiveWorker],
        store: Any,
        console: Console,
        start: StartWorker,
        *,
        budget: int,
        restarts: int = 0,
    ) -> None:
        self.spec, self.layout, self.workers, self.store = spec, layout, workers, store
        self.console, self.start = console, start
        self.nodes = NodeHeartbeat(store, layout.node, layout.nodes)
        self.faults: list[LiveWorker] = []
        self.errors: list[LiveWorker] = []  # ERRORs: each ends the job (live_account.py)
        self.replacements = Replacements(
            budget, store
        )  # --max-restarts left: replacements, whole-job restarts
        self.restarts = restarts  # whole-job restarts before this attempt
        self.changes_seen = 0
        self.evictions_read = 0.0  # when the dead marks of running workers were last read
        self.closed = False
        self.ending = False  # every worker is being stopped: an ERROR here or (`ended`) on another node
        self.ended_elsewhere = ""
        self.kill_at: float | None = None
        self.over = False  # the main thread decided (an interrupt, the store lost): the looker stops
        self.lock = threading.Lock()  # one look at a time, and none after the main thread decided
        self.reached = time.monotonic()  # the last time the store answered
        self.store_error = ""

    def run(self, interrupted: list[int]) -> tuple[int, str]:
        """Watch until the job is over on this node. The looking happens in a thread: a store call to node
        0 over a link that went down blocks without end, and then this thread still decides."""
        outcome: list[tuple[int, str]] = []
        looker = threading.Thread(target=self._look, args=(outcome,), name="lockstep-live", daemon=True)
        looker.start()
        while looker.is_alive():
            if interrupted:
                sig = interrupted[0]
                self._stop_all(sig)
                return (
                    128 + sig,
                    f"lockstep run: interrupted by {signal.Signals(sig).name}; every worker was stopped",
                )
            lost_for = time.monotonic() - self.reached
            if lost_for > STORE_LOST_S:
                return self._store_lost(lost_for)
            looker.join(POLL_S)
        return outcome[0]

    def restart_due(self) -> bool:
        """The attempt ended with a job-ending error on this single node and --max-restarts allows
        another: the launcher restarts the whole job (launch/live_launch.py)."""
        return bool(self.errors) and self.layout.nodes == 1 and self.replacements.left > 0

    def _stop_all(self, sig: int) -> None:
        """The main thread's decision: no look after this one may report these workers' ends as faults."""
        locked = self.lock.acquire(timeout=LOCK_WAIT_S)
        try:
            self.over = True
            signal_all(self.workers, sig)
        finally:
            if locked:
                self.lock.release()

    def _look(self, outcome: list[tuple[int, str]]) -> None:
        while True:
            try:
                with self.lock:
                    if self.over:
                        return
                    result = self._tick()
            except (RuntimeError, OSError) as exc:  # the store did not answer (DistStoreError is one)
                self.store_error = _first_line(exc)
                time.sleep(POLL_S)
                continue
            self.reached = time.monotonic()
            if result is not None:
                outcome.append(result)
                return
            time.sleep(POLL_S)

    def _tick(self) -> tuple[int, str] | None:
        """One look at the workers and the store; the launcher's outcome once it is over."""
        self._kill_evicted()
        for w in list(self.workers):
            if w.ended_at is None and w.proc.poll() is not None:
                self._ended(w)
        self._end_if_due()
        self.nodes.beat()
        running = self._running()
        if not running:
            self.nodes.mark("done")
            if self.layout.node == 0 and not self.nodes.others_over():
                return None  # the store must outlive every node's workers
            return self._final()
        if self.ending:
            return None
        if self.layout.nodes == 1 and self._in_job() < (self.spec.min_world or 1) and self.faults:
            failures = [w.failure() for w in self.faults]
            n = self.spec.nproc_per_node
            return exit_code(first_failure(failures)), (
                f"lockstep run: FAILED: {self._in_job()} of {n} ranks left, fewer than --min-world "
                f"{self.spec.min_world}\n" + format_failure(failures, n)
            )
        self._close_if_only_queued(running)
        return None

    def _final(self) -> tuple[int, str]:
        """The outcome once every worker of this node ended."""
        if self.ended_elsewhere and not self.errors:
            return 1, (
                f"lockstep run: FAILED: the job ended on another node ({self.ended_elsewhere}); this node's "
                "workers were stopped. Live mode cannot restart the whole job across nodes: launch it again "
                "on every node to resume from its last checkpoint"
            )
        code, report = outcome(self.workers, self.layout.per_node, self.restarts)
        if self.errors and self.layout.nodes > 1:
            report += (
                "\nlockstep run: the error ended the job on every node; live mode cannot restart the whole "
                "job across nodes: launch it again on every node to resume from its last checkpoint"
            )
        if code == 0:  # the run's goodput, from the first member that finished (rank 0's, if it did)
            finished = sorted((w for w in self.workers if w.proc.returncode == 0), key=lambda w: w.member_id)
            line = goodput_line(w.rank_dir for w in finished)
            report = f"{report}\n{line}" if report and line else (report or line)
        remote = self._lost_elsewhere() if self.layout.nodes > 1 and code == 0 else ""
        if remote:
            line = f"lockstep run: node {self.layout.node}'s ranks finished; lost on other nodes: {remote}"
            report = f"{report}\n{line}" if report else line
        return code, report

    def _end_if_due(self) -> None:
        """A job-ending error here, or `ended` on the store from another node: stop every worker (SIGTERM,
        then SIGKILL after the grace: they may be stuck in a collective with the failed one)."""
        if self.ending:
            if self.kill_at is not None and time.monotonic() > self.kill_at:
                signal_all(self.workers, signal.SIGKILL)
                self.kill_at = None
            return
        if not self.errors and self.layout.nodes > 1 and self.store.check([JOB_ENDED]):
            self.ended_elsewhere = bytes(self.store.get(JOB_ENDED)).decode()
        if not self.errors and not self.ended_elsewhere:
            return
        if self.errors and self.layout.nodes > 1:
            self.store.compare_set(JOB_ENDED, "", f"node {self.layout.node}: {error_summary(self.errors[0])}")
        self.ending = True
        signal_all(self.workers, signal.SIGTERM)
        self.kill_at = time.monotonic() + self.spec.shutdown_grace

    def _store_lost(self, lost_for: float) -> tuple[int, str]:
        self._stop_all(signal.SIGKILL)
        why = f" ({self.store_error})" if self.store_error else ""
        return 1, (
            f"lockstep run: node {self.layout.node} lost the job's store at {self.layout.host}:"
            f"{self.layout.port} for {lost_for:.0f} s{why}: its link or node 0 is gone. This node's workers "
            f"were stopped; the other nodes go on while at least --min-world {self.spec.min_world} ranks remain"
        )

    def _running(self) -> list[LiveWorker]:
        return [w for w in self.workers if w.ended_at is None]

    def _in_job(self) -> int:
        ended_ok = sum(1 for w in self.workers if w.ended_at is not None and w.proc.returncode == 0)
        return len(self._running()) + ended_ok

    def _members_running(self) -> int:
        """Running workers that are members: replacements still queued to join are not (yet)."""
        return sum(1 for w in self._running() if not w.joiner or self._admitted(w))

    def _admitted(self, w: LiveWorker) -> bool:
        if not w.admitted and self.store.check([keys.admit(w.member_id)]):
            w.admitted = True
        return w.admitted

    def _marked_dead(self, member_id: int) -> str | None:
        key = keys.dead(member_id)
        return bytes(self.store.get(key)).decode() if self.store.check([key]) else None

    def _kill_evicted(self) -> None:
        """The survivors marked a running worker dead (it stopped answering, or was left out of a
        generation it did not check in to): end it for good. An eviction counts a change; leaving a
        member out does not (the others have agreed already), so the marks are also read every second."""
        changes = int(self.store.add(keys.CHANGES, 0))
        if changes == self.changes_seen and time.monotonic() - self.evictions_read < EVICTIONS_READ_S:
            return
        self.changes_seen, self.evictions_read = changes, time.monotonic()
        for w in self._running():
            if w.evicted is None and (why := self._marked_dead(w.member_id)) is not None:
                w.evicted = why
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)  # SIGKILL ends a stopped process too
                except (ProcessLookupError, PermissionError):
                    pass

    def _ended(self, w: LiveWorker) -> None:
        """Count how `w` ended (live_account.py) and act on a FAULT or an ERROR."""
        w.ended_at = time.time()
        if w.stopped:
            return
        if w.evicted is None and w.proc.returncode != 0:
            w.evicted = self._marked_dead(w.member_id)  # the survivors marked it dead before it ended
        if w.joiner:
            self._admitted(w)
        kind = ending(w)
        if kind is Ending.ERROR:
            self.errors.append(w)
            return
        if kind is not Ending.FAULT or self.ending or (not self._running() and self.layout.nodes == 1):
            return
        if w.evicted is None:
            self.store.add(keys.CHANGES, 1)  # counted before marked (runtime/membership/core.py)
            self.store.set(keys.dead(w.member_id), w.how())
        self.faults.append(w)
        self._fault_line(w)

    def _fault_line(self, w: LiveWorker) -> None:
        """Say what was lost and who goes on; start a replacement while the job goes on and one is left."""
        goes_on = self.layout.nodes > 1 or self._in_job() >= (self.spec.min_world or 1)
        here = str(self.layout.world) if self.layout.nodes == 1 else f"{self.layout.per_node} on this node"
        line = (
            f"lockstep run: rank {w.member_id} {w.how()}; {self._members_running()} of {here} ranks "
            + ("go on" if goes_on else "left")
            + f" (--min-world {self.spec.min_world})"
        )
        if goes_on and not self.ending and self.replacements.replace(w.member_id, w.evicted or ""):
            member_id = self.layout.world + int(self.store.add(keys.REPLACEMENTS, 1)) - 1  # unique job-wide
            self.start(member_id, w.rank, w.local_rank, True)
            line += (
                f"; replacement rank {member_id} started, it joins at a step boundary "
                f"({self.replacements.left} replacements left)"
            )
        self.console.line("stderr", line)

    def _lost_elsewhere(self) -> str:
        """The members of other nodes marked dead on the store, with how, for the last line."""
        mine = {w.member_id for w in self.workers}
        launched = self.layout.world + int(self.store.add(keys.REPLACEMENTS, 0))
        lost = []
        for member_id in range(launched):
            if member_id not in mine and (how := self._marked_dead(member_id)) is not None:
                lost.append(f"rank {member_id} ({how})")
        return ", ".join(lost)

    def _close_if_only_queued(self, running: list[LiveWorker]) -> None:
        """Only replacements that were never admitted still run, on every node: the job is over, tell them."""
        if self.closed:
            return
        idle = all(w.joiner for w in running) and not any(self._admitted(w) for w in running)
        if self.layout.nodes > 1:
            if idle:
                self.nodes.mark("idle")
            idle = idle and self.nodes.all_idle()
        if idle:
            self.store.set(keys.CLOSED, "1")
            self.closed = True


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
