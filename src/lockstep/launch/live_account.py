"""Live mode's account of how each worker ended, and the launcher's last word on the job from it.

How a worker ended decides what the launcher does (`ending`), checked in this order:

- STOPPED: the launcher stopped it itself (Ctrl-C/SIGTERM, the job's end, a job-ending error, a restart).
  Not a fault: no line, no replacement.
- FINISHED: it exited 0 and trained to the end: one of the workers launched first, or a replacement the
  members admitted (`admit/<member>` on the store).
- NOT_NEEDED: a replacement that exited 0 without ever being admitted (the job ended before it joined).
  Not a finisher.
- FAULT: the job goes on without it (replaced while --max-restarts allows): killed by a signal; evicted
  (marked dead on the store by the survivors or by itself, `dead/<member>`, or exit 75 =
  EVICTED_EXIT_CODE); or exited non-zero without an exception record (os._exit, a crash in C code).
- ERROR: it exited non-zero with a Python exception recorded by its bootstrap (error.json,
  launch/worker.py): an InternalError, a WorldTooSmallError, an escaping MembershipChanged, the
  program's own exception or its sys.exit(N); or its hang watchdog ended it with a hang report (exit
  124: a hang that live mode cannot evict, reported on every rank). A lost peer never ends a worker this way on purpose, so
  this ends the job: every other worker is stopped, nothing is replaced, and with --max-restarts left
  (one node) the whole job restarts from its last checkpoint (launch/live_launch.py).

`outcome` turns the account into the exit code and the last lines: non-zero whenever training did not
finish, "finished" only when it did, counting only the FINISHED workers.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from lockstep.launch.failure_report import first_failure, format_failure
from lockstep.launch.live_workers import LiveWorker, exit_code
from lockstep.runtime.membership import keys
from lockstep.runtime.membership.formation import EVICTED_EXIT_CODE
from lockstep.runtime.membership.replica_groups import group_of, lost_with_group
from lockstep.runtime.watchdog import STALL_EXIT_CODE


class Ending(enum.Enum):
    """How a worker ended, as the launcher counts it (see the module doc)."""

    STOPPED = "stopped by the launcher"
    FINISHED = "finished"
    NOT_NEEDED = "not needed"
    FAULT = "fault"
    ERROR = "job-ending error"


def ending(w: LiveWorker) -> Ending:
    """How the ended worker `w` counts (the module doc's rule). `w.evicted` and `w.admitted` must be read
    from the store first."""
    code = w.proc.returncode
    if w.stopped:
        return Ending.STOPPED
    if code == 0:
        return Ending.FINISHED if (not w.joiner or w.admitted) else Ending.NOT_NEEDED
    if w.evicted is not None or code is None or code < 0 or code == EVICTED_EXIT_CODE:
        return Ending.FAULT
    return Ending.ERROR if w.raised() or code == STALL_EXIT_CODE else Ending.FAULT


def outcome(workers: list[LiveWorker], world: int, restarts: int) -> tuple[int, str]:
    """The launcher's exit code and last lines once every worker of this node ended; `world`: the workers
    launched first on this node, `restarts`: the whole-job restarts done before this attempt."""
    endings = {id(w): ending(w) for w in workers}
    errors = [w for w in workers if endings[id(w)] is Ending.ERROR]
    faults = [w for w in workers if endings[id(w)] is Ending.FAULT]
    finished = [w for w in workers if endings[id(w)] is Ending.FINISHED]
    if errors:
        stopped = [w for w in workers if endings[id(w)] is Ending.STOPPED and w.proc.returncode != 0]
        failures = [w.failure() for w in errors + stopped]
        return exit_code(first_failure(failures)), format_failure(failures, world)
    if not finished:
        failures = [w.failure() for w in faults] or [w.failure() for w in workers]
        return exit_code(first_failure(failures)), format_failure(failures, world)
    if not faults and not restarts:
        return 0, ""
    joined = [w.member_id for w in finished if w.joiner]
    replaced = f" ({len(joined)} of them replacements: ranks {joined})" if joined else ""
    lost = ", ".join(f"rank {w.member_id} ({w.how()})" for w in faults)
    return 0, (
        f"lockstep run: finished on {len(finished)} of {world} ranks{replaced}, {restart_words(restarts)}"
        + (f"; lost {lost}" if lost else "")
    )


def restart_words(restarts: int) -> str:
    if restarts == 0:
        return "without a restart"
    return f"after {restarts} restart{'s' if restarts > 1 else ''} of the whole job"


def error_summary(w: LiveWorker) -> str:
    """One line's worth on a job-ending error: its exception line, or its exit code."""
    record = w.failure().record
    message = str(record.get("message", "")).strip() if record else ""
    first = message.splitlines()[0] if message else w.how()
    return f"rank {w.member_id} raised {first}" if message else f"rank {w.member_id} {first}"


class Replacements:
    """--max-restarts as the launcher spends it in live mode (`left`: replacements and whole-job restarts):
    one per lost worker, or one per lost replica group of a sharded run, whose members (killed with it, or
    left out with it: their dead mark names it) are replaced with it, or not at all, whichever of them ends
    first. The groups are read from the job's `store` (`group_size`, each generation's `members`:
    runtime/membership/replica_groups.py `group_of`); before the members hold to groups, by dead marks."""

    def __init__(self, budget: int, store: Any) -> None:
        self.left, self.store = budget, store
        self.decided: dict[tuple[int, ...], bool] = {}  # by lost group (a member on its own: a group of one)
        self.generations: list[list[int]] = []  # generations 0, 1, ...: their members, as read so far

    def replace(self, member_id: int, dead_mark: str) -> bool:
        """Whether lost worker `member_id` (marked dead with `dead_mark`, or "") gets a replacement."""
        key = self._group(member_id)
        if len(key) == 1:
            mate = lost_with_group(dead_mark)
            key = (member_id if mate is None else mate,)
        if key not in self.decided:
            self.decided[key] = self.left > 0
            self.left -= int(self.decided[key])
        return self.decided[key]

    def _group(self, member_id: int) -> tuple[int, ...]:
        """The replica group `member_id` was last a member of, from the store; (member_id,) when the store
        cannot be read (the dead marks then decide, as before the members held to groups)."""
        try:
            size = self._read(keys.GROUP_SIZE)
            if size is None or int(size) <= 1:
                return (member_id,)
            while (members := self._read(keys.members(len(self.generations)))) is not None:
                self.generations.append(json.loads(members))
        except (RuntimeError, OSError):  # DistStoreError, a connection lost: this look only
            return (member_id,)
        return group_of(member_id, self.generations, int(size))

    def _read(self, key: str) -> str | None:
        return bytes(self.store.get(key)).decode() if self.store.check([key]) else None
