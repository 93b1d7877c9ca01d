"""runtime/sigterm_guard.py in a real process: SIGTERM is held while a collective is waited on and
delivered as the handler before the guard would have had it, once the wait ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    from lockstep.runtime.sigterm_guard import SigtermGuard

    mode = sys.argv[1]
    if mode == "user_handler":
        def on_term(signum, frame):
            print("user handler ran", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, on_term)
    guard = SigtermGuard()
    assert guard.install()
    if mode == "outside":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived", flush=True)
    else:
        guard.enter()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler has run: the signal is held
        print("held", flush=True)
        guard.leave()
        print("after leave", flush=True)
    """
)


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60, check=False
    )


def test_outside_a_collective_sigterm_kills_at_once() -> None:
    result = _run("outside")
    assert result.returncode == -signal.SIGTERM, result
    assert "survived" not in result.stdout


def test_inside_a_collective_sigterm_waits_for_the_wait_to_end_then_kills() -> None:
    result = _run("inside")
    assert result.returncode == -signal.SIGTERM, result
    assert result.stdout.splitlines() == ["held"], result.stdout


def test_a_held_sigterm_goes_to_the_programs_own_handler() -> None:
    result = _run("user_handler")
    assert result.returncode == 7, result
    assert result.stdout.splitlines() == ["held", "user handler ran"], result.stdout
