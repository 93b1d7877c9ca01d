"""The launcher's signals: SIGINT/SIGTERM/... stop the run through torch's agent; SIGUSR1/2 go on to the workers.

- Ctrl-C / SIGTERM (and SIGHUP, SIGQUIT) raise `LaunchInterrupted`, a torch `SignalException`, in the
  launcher; torch's agent answers it by forwarding the signal to every worker's process group and
  SIGKILLing them after the shutdown grace (launch/local.py then sweeps what is left).
- SIGUSR1 / SIGUSR2 are passed on to every worker (not to their DataLoader workers), and the run goes on:
  SLURM's `--signal=USR1@T` before the time limit reaches the training script.
- `held_signals()` holds the first group off while the launcher cleans up, so a second Ctrl-C cannot cut
  the cleanup short.

This module imports torch (torch's agent catches its own exception type); launch/local.py imports it
only once the cheap checks of a launch have passed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException

from lockstep.errors import LaunchError
from lockstep.launch.process_sweep import worker_pids

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # for the script (e.g. SLURM's "checkpoint now")


class LaunchInterrupted(LaunchError, SignalException):
    """The launcher got a stopping signal: torch's agent stops the workers with it (`sigval`), and the
    launch ends with exit code 128 + that signal."""

    def __init__(self, signum: int) -> None:
        sig = signal.Signals(signum)
        SignalException.__init__(self, f"lockstep run got {sig.name}", sigval=sig)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """From the first moment, HANDLED_SIGNALS raise LaunchInterrupted in the launcher (see the module doc);
    the previous handlers come back afterwards."""

    def handler(signum: int, frame: Any) -> None:
        raise LaunchInterrupted(signum)

    saved = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def forward_signals(rank_dirs: Callable[[], list[str]]) -> Iterator[None]:
    """SIGUSR1/SIGUSR2 sent to the launcher go on to every worker of this node's current attempt (the
    workers that wrote their pids in `rank_dirs()`), and the run goes on (what the script does with them is
    its own business: SLURM's `--signal=USR1@T` asks it to checkpoint before the time limit). To the worker
    process only: its DataLoader workers would die of them.

    A signal the launcher was started with ignored stays ignored, as a shell leaves it: `lockstep slurm`'s
    script starts the launchers under `trap '' USR1` because srun already delivers USR1 to every process of
    the step, workers included, and they must not get it twice.
    """

    def forward(signum: int, frame: Any) -> None:
        for pid in worker_pids(rank_dirs()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    saved = {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS}
    forwarded = [sig for sig, previous in saved.items() if previous != signal.SIG_IGN]
    for sig in forwarded:
        signal.signal(sig, forward)
    try:
        yield
    finally:
        for sig in forwarded:
            previous = saved[sig]
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Block HANDLED_SIGNALS for the duration (they are delivered afterwards, when the mask comes back)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
