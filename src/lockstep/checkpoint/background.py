"""A checkpoint written on a thread of the writer rank while training goes on (one write at a time).

The thread encodes and writes a snapshot (snapshot.py) with the same atomic layout as a blocking save. Its
outcome is collected by the next save, by `CheckpointManager.wait()` or by a load, which all ranks call:
a failure is raised there on every rank, naming the file, and logged on the writer as soon as it happens,
so that it is never silent. The thread is not a daemon: a process that ends without waiting still
finishes the write before it exits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class BackgroundWrite:
    """One write of checkpoint `step` running `write` on its own thread."""

    def __init__(self, step: int, write: Callable[[], None], log: logging.Logger) -> None:
        self.step = step
        self._write, self._log = write, log
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"lockstep-checkpoint-{step}", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as exc:  # collected by join(); logged now in case nobody asks again
            self._failure = exc
            self._log.error(
                "background checkpoint of step %d failed: %s (raised on every rank at the next save or wait())",
                self.step,
                exc,
            )

    def join(self) -> BaseException | None:
        """Wait for the write; its exception, or None when the checkpoint is complete."""
        self._thread.join()
        return self._failure
