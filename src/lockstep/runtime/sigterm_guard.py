"""Hold the launcher's SIGTERM back while this rank waits in a collective, so a failure's report gets out.

When a rank dies (gloo kills a rank whose collective mismatches its peers' with SIGABRT, from its own I/O
thread), the launcher stops every other worker with SIGTERM within its monitor interval (0.1 s). The rank
whose collective failed because of that death is the one that can say why: which rank, where the
collective sequences parted. With SIGTERM's default action it can die between its collective raising and
its watchdog writing the report, and the job then ends with no report at all.

So while the watchdog runs, SIGTERM has a handler: outside a collective it does what the handler before
it did (by default: die by SIGTERM, so the launcher still sees a worker it stopped); inside one it notes
the signal, and the main thread delivers it when the wait ends, either normally or once the failure's
report is out (bounded by the watchdog). Python runs a handler on the main thread only, between
bytecodes: a signal that arrives while the main thread blocks in C++ is handled when the call returns.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any


class SigtermGuard:
    def __init__(self) -> None:
        self._pid = os.getpid()
        self._previous: Any = None
        self._installed = False
        self._depth = 0  # collectives being waited on (nested: a tracked wait inside another's report)
        self._held = False
        self._held_frame: FrameType | None = None

    def install(self) -> bool:
        """Take over SIGTERM (main thread only: Python allows no handler elsewhere); False where it cannot."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Give SIGTERM back to the handler before this one, if this one is still the handler."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)
        self.release()

    def enter(self) -> None:
        self._depth += 1

    def leave(self) -> None:
        self._depth -= 1
        if self._depth <= 0:
            self._depth = 0
            self.release()

    def release(self) -> None:
        """Deliver a held SIGTERM now (main thread)."""
        if self._held:
            self._held = False
            self._deliver(self._held_frame)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._depth > 0 and os.getpid() == self._pid:
            self._held, self._held_frame = True, frame
            return
        self._deliver(frame)  # between collectives, or a forked child (a DataLoader worker)

    def _deliver(self, frame: FrameType | None) -> None:
        previous = self._previous
        if callable(previous):
            previous(signal.SIGTERM, frame)
        elif previous != signal.SIG_IGN:
            # The default action: die by the signal itself, as the launcher expects of a worker it stops.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
