"""Live mode's supervisor: the launcher's loop that watches its workers and tells the store what it sees.

- A worker that exits non-zero or is killed while others run is a fault: the supervisor counts a change
  and writes `dead/<member>` = how it ended to the store at once (survivors that were not its neighbours
  learn it there), prints one line, and the others go on.
- Fewer than --min-world workers left running, and the rest not finished: the job fails (one node).
- A worker that the survivors evicted (it stopped answering: SIGSTOP, a hard hang; they mark it dead on
  the store themselves) is killed, so that it cannot wake up into a group that went on without it.
- With `--max-restarts R`, each lost worker (while the job goes on, up to R in all) is replaced by a new
  process with the next member id and the lost one's RANK/LOCAL_RANK (its device). It queues on the store
  and the members admit it at a step boundary (runtime/membership/admission.py). Once only replacements
  that were never admitted still run, on every node, the supervisor writes `closed` and they exit 0.
- On several nodes, node 0's supervisor keeps the store up until every other node is done or silent
  (launch/node_heartbeat.py); a node that cannot reach the store for STORE_LOST_S stops its workers.

The store keys are named in runtime/membership/keys.py; docs/live.md draws the protocol.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lockstep.launch.console_relay import Console
from lockstep.launch.failure_report import first_failure, format_failure
from lockstep.launch.live_workers import POLL_S, LiveWorker, exit_code, signal_all
from lockstep.launch.node_heartbeat import NodeHeartbeat
from lockstep.launch.spec import LaunchSpec
from lockstep.runtime.membership import keys

STORE_LOST_S = 10.0  # a node that could not reach the store this long stops its workers and leaves the job

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
    """The launcher's loop in live mode (see the module doc)."""

    def __init__(
        self,
        spec: LaunchSpec,
        layout: NodeLayout,
        workers: list[LiveWorker],
        store: Any,
        console: Console,
        start: StartWorker,
    ) -> None:
        self.spec, self.layout, self.workers, self.store = spec, layout, workers, store
        self.console, self.start = console, start
        self.nodes = NodeHeartbeat(store, layout.node, layout.nodes)
        self.faults: list[LiveWorker] = []
        self.replacements_left = spec.max_restarts
        self.changes_seen = 0
        self.closed = False
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
                signal_all(self.workers, sig)
                return (
                    128 + sig,
                    f"lockstep run: interrupted by {signal.Signals(sig).name}; every worker was stopped",
                )
            lost_for = time.monotonic() - self.reached
            if lost_for > STORE_LOST_S:
                return self._store_lost(lost_for)
            looker.join(POLL_S)
        return outcome[0]

    def _look(self, outcome: list[tuple[int, str]]) -> None:
        while True:
            try:
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
        self.nodes.beat()
        running = self._running()
        if not running:
            self.nodes.mark("done")
            if self.layout.node == 0 and not self.nodes.others_over():
                return None  # the store must outlive every node's workers
            code, report = outcome(self.workers, self.faults)
            remote = self._lost_elsewhere() if self.layout.nodes > 1 and code == 0 else ""
            if remote:
                line = (
                    f"lockstep run: node {self.layout.node}'s ranks finished; lost on other nodes: {remote}"
                )
                report = f"{report}\n{line}" if report else line
            return code, report
        if self.layout.nodes == 1 and self._in_job() < (self.spec.min_world or 1) and self.faults:
            failures = [w.failure() for w in self.faults]
            n = self.spec.nproc_per_node
            return exit_code(first_failure(failures)), (
                f"lockstep run: FAILED: {self._in_job()} of {n} ranks left, fewer than --min-world "
                f"{self.spec.min_world}\n" + format_failure(failures, n)
            )
        self._close_if_only_queued(running)
        return None

    def _store_lost(self, lost_for: float) -> tuple[int, str]:
        signal_all(self.workers, signal.SIGKILL)
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

    def _marked_dead(self, member_id: int) -> str | None:
        key = keys.dead(member_id)
        return bytes(self.store.get(key)).decode() if self.store.check([key]) else None

    def _kill_evicted(self) -> None:
        """The survivors marked a running worker dead (it stopped answering): end it for good."""
        changes = int(self.store.add(keys.CHANGES, 0))
        if changes == self.changes_seen:
            return
        self.changes_seen = changes
        for w in self._running():
            if w.evicted is None and (why := self._marked_dead(w.member_id)) is not None:
                w.evicted = why
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)  # SIGKILL ends a stopped process too
                except (ProcessLookupError, PermissionError):
                    pass

    def _ended(self, w: LiveWorker) -> None:
        w.ended_at = time.time()
        running = self._running()
        if w.proc.returncode == 0 or (not running and self.layout.nodes == 1):
            return
        if w.evicted is None and (why := self._marked_dead(w.member_id)) is not None:
            w.evicted = why  # it marked itself dead (a replacement that could not heal)
        if w.evicted is None:
            self.store.add(keys.CHANGES, 1)  # counted before marked (runtime/membership/core.py)
            self.store.set(keys.dead(w.member_id), w.how())
        self.faults.append(w)
        goes_on = self.layout.nodes > 1 or self._in_job() >= (self.spec.min_world or 1)
        here = len(self.workers) if self.layout.nodes == 1 else f"{len(self.workers)} on this node"
        line = (
            f"lockstep run: rank {w.member_id} {w.how()}; {len(running)} of {here} ranks "
            + ("go on" if goes_on else "left")
            + f" (--min-world {self.spec.min_world})"
        )
        if goes_on and self.replacements_left > 0:
            self.replacements_left -= 1
            member_id = self.layout.world + int(self.store.add(keys.REPLACEMENTS, 1)) - 1  # unique job-wide
            self.start(member_id, w.rank, w.local_rank, True)
            line += (
                f"; replacement rank {member_id} started, it joins at a step boundary "
                f"({self.replacements_left} replacements left)"
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
        idle = all(w.joiner for w in running) and not any(
            self.store.check([keys.admit(w.member_id)]) for w in running
        )
        if self.layout.nodes > 1:
            if idle:
                self.nodes.mark("idle")
            idle = idle and self.nodes.all_idle()
        if idle:
            self.store.set(keys.CLOSED, "1")
            self.closed = True


def outcome(workers: list[LiveWorker], faults: list[LiveWorker]) -> tuple[int, str]:
    """The launcher's exit code and last lines once every worker of this node ended."""
    finished = [w for w in workers if w not in faults]
    failed = [w for w in finished if w.proc.returncode != 0]
    if failed or not finished:
        failures = [w.failure() for w in (failed or faults)]
        return exit_code(first_failure(failures)), format_failure(failures, len(workers))
    if not faults:
        return 0, ""
    lost = ", ".join(f"rank {w.member_id} ({w.how()})" for w in faults)
    started = sum(1 for w in workers if not w.joiner)
    joined = [w.member_id for w in finished if w.joiner]
    replaced = f" ({len(joined)} of them replacements: ranks {joined})" if joined else ""
    return (
        0,
        f"lockstep run: finished on {len(finished)} of {started} ranks{replaced}, without a restart; lost {lost}",
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
