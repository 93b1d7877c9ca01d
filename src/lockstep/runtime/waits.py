"""How the main thread waits on lockstep's collectives: tracked for the hang watchdog, given up on a lost member.

Every collective lockstep issues is waited on through here:
- `tracked(op, tensors, group)`: a synchronous collective of lockstep's own (the small collectives,
  SyncBatchNorm, join, broadcasts): numbered (runtime/progress.py), marked as waited on for the block,
  reported by the watchdog if it raises;
- `wait_tracked(record, work)`: an asynchronous one issued earlier (an engine bucket);
- `wait_watching_membership(work)`: the wait itself. Outside live mode it is `work.wait()`. In live mode
  gloo cannot abort a collective, and one that waits on a dead rank's peers would block for the group's
  timeout; so the wait polls, and every few milliseconds asks the membership it watches whether a member
  was lost, which raises MembershipChanged (runtime/membership/). A Work that completes only inside its
  wait() (gloo's reduce-scatter, which FSDP2 and the sharded exact sums issue) is waited on by a thread of
  its own while this one polls.

While a collective is waited on, SIGTERM is held back (runtime/sigterm_guard.py) so that the watchdog's
report of a failure gets out first.

Which membership the waits watch is set by the one place that forms a live group
(runtime/process_group.init, through `watch_membership`) and cleared when it is left: an object with a
`check()` method (watchdog.MembershipWatch), not a callable planted in another module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lockstep.runtime import watchdog
from lockstep.runtime.progress import PROGRESS, CollectiveRecord

CHECK_EVERY_S = 0.01  # how often a live-mode wait asks whether a member was lost
_POLL_S = 0.0002


class _Watched:
    """The membership that this process's waits watch (live mode), or None."""

    membership: watchdog.MembershipWatch | None = None


_watched = _Watched()


def watch_membership(membership: watchdog.MembershipWatch | None) -> None:
    """From now on, waits give up when `membership.check()` raises (None: plain waits again)."""
    _watched.membership = membership


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
    dog = watchdog.current()
    if publish and dog is not None:
        dog.publish_issued(rec)
    with _Waiting(dog, rec):
        yield rec


def wait_tracked(rec: CollectiveRecord, work: Any) -> Any:
    """Wait on an asynchronous collective issued earlier (an engine bucket): marked, reported if it raises."""
    with _Waiting(watchdog.current(), rec):
        value = wait_watching_membership(work)
    # The record stays among the recent ones (PROGRESS.recent, for hang reports): without its Work or
    # Future, which hold the collective's tensors (a gradient bucket's whole buffer) for as long as it lives.
    rec.work, rec.done = None, True
    return value


def wait_watching_membership(work: Any) -> Any:
    """work.wait(); in live mode the wait polls and raises MembershipChanged when a member is lost (gloo
    cannot abort a collective, and one that waits on a dead rank's peers would block for its timeout)."""
    membership = _watched.membership
    if membership is None or work is None:
        return work.wait() if work is not None else None
    next_check = 0.0
    # A c10d Work (is_completed) or a torch Future (done): the engine's buckets wait on the latter.
    completed = work.is_completed if hasattr(work, "is_completed") else work.done
    if not completed() and _completes_only_in_wait(work):
        return _wait_aside(work, membership)
    while not completed():
        now = time.monotonic()
        if now >= next_check:
            membership.check()
            next_check = now + CHECK_EVERY_S
        time.sleep(_POLL_S)
    return work.wait()


def _completes_only_in_wait(work: Any) -> bool:
    """A Work that says it is complete only once wait() ran (gloo's reduce-scatter: it has no future, and
    is_completed() stays False however long it is polled)."""
    if not hasattr(work, "get_future"):
        return False
    try:
        work.get_future()
    except RuntimeError:
        return True
    return False


def _wait_aside(work: Any, membership: watchdog.MembershipWatch) -> Any:
    """work.wait() on a thread of its own while this one watches the membership: a lost member raises
    MembershipChanged here at once (the thread stays blocked in the abandoned group's wait, which ends
    when the group's sockets close)."""
    done, outcome = threading.Event(), {}

    def wait() -> None:
        try:
            outcome["value"] = work.wait()
        except BaseException as exc:  # raised on the waiting thread below, with its traceback
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=wait, name="lockstep-wait", daemon=True).start()
    while not done.wait(CHECK_EVERY_S):
        membership.check()
    error = outcome.get("error")
    if error is not None:
        raise error  # the wait's own failure (a lost peer's transport error), as wait() raised it
    return outcome["value"]


class _Waiting:
    """The main thread waits on `rec`: marked for the watchdog, SIGTERM held meanwhile, reported if it
    raises. A class, not a generator-based context manager: the engine enters one per bucket and step."""

    __slots__ = ("guard", "rec")

    def __init__(self, dog: watchdog.Watchdog | None, rec: CollectiveRecord) -> None:
        self.guard = dog.guard if dog is not None else None
        self.rec = rec

    def __enter__(self) -> None:
        if self.guard is not None:
            self.guard.enter()
        PROGRESS.begin_wait(self.rec)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: Any) -> None:
        try:
            if exc is None:
                PROGRESS.end_wait()
            elif isinstance(exc, (RuntimeError, dist.DistError)):
                collective_failed(self.rec, exc)
        finally:
            if self.guard is not None:
                self.guard.leave()


def collective_failed(rec: CollectiveRecord, exc: BaseException) -> None:
    """A collective raised on the main thread: record it and let the watchdog report before it propagates."""
    PROGRESS.fail(rec, exc)
    dog = watchdog.current()
    if dog is not None:
        dog.collective_failed()
