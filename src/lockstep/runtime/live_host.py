"""The process around a live group: runtime's side of membership/host.py's `Host`.

process_group.init() hands a `ProcessHost` to the live group it forms (runtime/membership/): the group
reaches the hang watchdog, the collective waits, this process's progress marks and the small
collectives through it, so that membership imports nothing from the rest of runtime.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import AbstractContextManager
from typing import Any

from lockstep.runtime import waits, watchdog
from lockstep.runtime.collectives import all_gather_object
from lockstep.runtime.process_inspection import gone, proc_view, seen_here, times_switched
from lockstep.runtime.progress import PROGRESS, RECOVERY, STATE_TRANSFER, phase
from lockstep.runtime.state_transfer import broadcast_state


class ProcessHost:
    """This process's watchdog, waits and collectives, for one live group (`report_dir`: where the
    watchdog writes its report)."""

    def __init__(self, report_dir: str | None) -> None:
        self.report_dir = report_dir

    def hang_timeout(self) -> float:
        return watchdog.hang_timeout_setting()

    def tracked(self, op: str) -> AbstractContextManager[object]:
        return waits.tracked(op, ())

    def recovering(self) -> AbstractContextManager[object]:
        return phase(RECOVERY)

    def watch(self, group: watchdog.MembershipWatch) -> None:
        waits.watch_membership(group)

    def stop_watchdog(self) -> float:
        waited = time.time() - PROGRESS.wait_since if PROGRESS.waiting is not None else 0.0
        watchdog.stop()
        return waited

    def start_watchdog(self, group: watchdog.MembershipWatch) -> None:
        PROGRESS.failed = None
        PROGRESS.waiting = None
        watchdog.start(watchdog.hang_timeout_setting(), self.report_dir, membership=group)

    def note_change(self, record: dict[str, Any]) -> None:
        if record.get("lost"):
            name, kind = f"lost members {record['lost']} ({'; '.join(record['how'].values())})", "fault"
        else:
            name, kind = f"replacements {record['joined']} joined", "replacement"
        PROGRESS.mark(name, kind=kind, step=record["step"], world_size=record["world_size"])

    def all_gather_object(self, obj: Any) -> list[Any]:
        return all_gather_object(obj)

    def broadcast_state(self, state: Any, src: int) -> Any:
        with phase(STATE_TRANSFER):
            return broadcast_state(state, src=src)

    def whereabouts(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "view": proc_view(), "pid": os.getpid()}

    def gone(self, whereabouts: dict[str, Any]) -> str | None:
        return gone(whereabouts, socket.gethostname())

    def times_switched(self, whereabouts: dict[str, Any]) -> int | None:
        here = seen_here(whereabouts, socket.gethostname())
        return times_switched(int(whereabouts["pid"])) if here else None
