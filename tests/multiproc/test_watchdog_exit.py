"""Ranks exit cleanly with lockstep's hang watchdog running (issue 49: exit -6 at teardown under load).

The watchdog's daemon thread calls the c10d store every tick. One still inside such a call when the
interpreter tears down is ended by CPython with pthread_exit() as it takes the GIL back; the unwinding
meets pybind11's noexcept gil_scoped_release destructor and the process aborts ("terminate called without
an active exception"). A program that formed its own group and never calls lockstep.shutdown(), as
torch's own DDP tests do, never stopped the thread: it aborted whenever the teardown caught the thread in a
store call (rare: a call is short; once in the compat suite on a loaded machine).

Each rank here is such a program: its own gloo group on a FileStore (as torch's c10d tests form it),
lockstep's class, one backward, destroy_process_group(), exit (the thread also ends by itself at its next
tick once the group is gone; the hook covers the call it may be in meanwhile). An atexit hook it registers first (so it
runs last, right before the teardown) prints the lockstep threads still alive: there must be none.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import child_env

EXIT_TIMEOUT_S = 120.0  # one pair, start to exit, on a loaded 2-core machine

RANK_PROGRAM = """
    import atexit, builtins, os, sys, threading, time

    def lockstep_threads_at_teardown():  # registered first: runs after every other atexit hook
        alive = [t.name for t in threading.enumerate() if t.name.startswith("lockstep-")]
        print(f"at teardown: {alive}", flush=True)

    atexit.register(lockstep_threads_at_teardown)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lockstep import DistributedDataParallel

    store_path, rank, held = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store = dist.FileStore(store_path, 2)  # kept: its destructor takes the file's lock, at teardown only
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(1337)
    model = DistributedDataParallel(torch.nn.EmbeddingBag(10, 10, sparse=True))  # test_sparse_gradients'
    inputs, target = torch.randint(0, 10, [2, 2]), torch.randint(0, 10, [2])
    F.cross_entropy(F.softmax(model(inputs), dim=1), target).backward()
    dog = next(t for t in threading.enumerate() if t.name == "lockstep-watchdog")
    print("watchdog running", flush=True)

    def in_store_call():
        frame = sys._current_frames().get(dog.ident)
        return frame is not None and frame.f_code.co_name in ("_publish", "_has_verdict")

    def stuck_in_store_call():  # in one, and still there a moment later
        if not in_store_call():
            return False
        time.sleep(0.2)
        return in_store_call()

    class SlowTeardown:
        def __del__(self):  # cleared late in the teardown: a teardown slowed down, as by a loaded machine
            time.sleep(2.0)

    if held != "-":  # the test holds the store's lock: wait until the thread is stuck in a store call
        while not os.path.exists(held):
            time.sleep(0.01)
        while not stuck_in_store_call():
            time.sleep(0.01)
        builtins.slow_teardown = SlowTeardown()
        print("watchdog in a store call", flush=True)
    dist.destroy_process_group()  # and exit, as torch's test harness does
"""


def _start_pair(
    tmp: Path, program: Path, held: Path | None, hang_timeout: str
) -> list[subprocess.Popen[str]]:
    env = child_env(LOCKSTEP_HANG_TIMEOUT=hang_timeout)
    store = tmp / "store"
    return [
        subprocess.Popen(
            [sys.executable, str(program), str(store), str(rank), str(held) if held else "-"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    """Each rank's exit code and output; a rank past the timeout is killed and fails the test."""
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=EXIT_TIMEOUT_S)
            results.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _assert_clean(results: list[tuple[int, str]], what: str) -> None:
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"{what}, rank {rank} exited {code}:\n{out[-3000:]}"
        assert "terminate called" not in out, out[-3000:]
        assert "watchdog running" in out, f"{what}, rank {rank}: no watchdog to test\n{out[-3000:]}"
        assert "at teardown: []" in out, f"{what}, rank {rank}: a lockstep thread outlived atexit\n{out}"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold `path`'s flock (FileStore takes it for every call: theirs block until it is released)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _wait_for_line(proc: subprocess.Popen[str], line: str, output: list[str]) -> None:
    assert proc.stdout is not None
    for got in proc.stdout:
        output.append(got)
        if got.strip() == line:
            return
    raise AssertionError(f"the rank ended before printing {line!r}:\n{''.join(output)[-3000:]}")


@pytest.mark.timeout(2 * EXIT_TIMEOUT_S)
def test_exit_while_the_watchdog_is_inside_a_store_call(tmp_path: Path) -> None:
    """Deterministic: the watchdog's store call is held up (the test holds the FileStore's lock) until
    the ranks' teardown is under way. Before the fix both ranks aborted (-6) in every run."""
    program = tmp_path / "rank.py"
    program.write_text(textwrap.dedent(RANK_PROGRAM))
    held = tmp_path / "held"
    procs = _start_pair(tmp_path, program, held, hang_timeout="5")  # a tick every 0.5 s
    outputs: list[list[str]] = [[], []]
    try:
        for proc, output in zip(procs, outputs):
            _wait_for_line(proc, "watchdog running", output)
        with _file_lock(tmp_path / "store"):
            held.touch()
            for proc, output in zip(procs, outputs):
                _wait_for_line(proc, "watchdog in a store call", output)
            time.sleep(0.5)  # the ranks are past their last line: into atexit and the teardown
    finally:
        results = _finish(procs)
    _assert_clean([(code, "".join(early) + out) for (code, out), early in zip(results, outputs)], "held")


@pytest.mark.slow  # 16 processes on a busy machine: about a minute
@pytest.mark.timeout(8 * EXIT_TIMEOUT_S)
def test_many_short_lived_ranks_exit_cleanly_beside_a_busy_loop(tmp_path: Path) -> None:
    """8 pairs, two at a time, beside a CPU-busy loop, each exiting right after its backward: every rank
    exits 0 with no lockstep thread left at the teardown (before the fix every rank had its watchdog
    still running there; that it was in a store call at that moment is what was rare)."""
    program = tmp_path / "rank.py"
    program.write_text(textwrap.dedent(RANK_PROGRAM))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for wave in range(4):
            dirs = [tmp_path / f"pair{wave}-{i}" for i in range(2)]
            pairs = []
            for pair_dir in dirs:
                pair_dir.mkdir()
                pairs.append(_start_pair(pair_dir, program, None, hang_timeout="10"))  # a tick a second
            for i, procs in enumerate(pairs):
                _assert_clean(_finish(procs), f"wave {wave}, pair {i}")
    finally:
        busy.kill()
        busy.wait()
