"""In-worker bootstrap: run the user's script or module with its argv untouched, and record how it failed.

The launcher starts each worker as `python -m lockstep.launch.worker script PATH ARGS...` (or
`module NAME ARGS...`). This module then

- writes its pid next to its error file, so the launcher can kill the worker's whole process group
  (DataLoader workers included) even when torch's agent was interrupted before it could;
- turns on faulthandler, so a crash in C code still leaves a Python stack in the rank's log;
- registers the Lightning strategy "lockstep" for when the script imports Lightning's strategies (if
  Lightning is installed; lockstep/startup), so that `strategy="lockstep"` works under `lockstep run`;
- runs the script exactly as `python PATH ARGS...` would (sys.argv, sys.path[0], `__main__`);
- after a script that ended well, leaves the process group it left open (Hugging Face's Trainer never
  destroys its own): torch's teardown of a live gloo group at interpreter exit aborts now and then;
- prints an uncaught exception with one rank prefix (`[rankN]: `), however many process groups the
  program formed (torch wraps sys.excepthook once per init_process_group: `_print_exception`);
- on an exception or a non-zero sys.exit, writes the traceback to TORCHELASTIC_ERROR_FILE in the JSON
  form torch's elastic agent reads, so the failure summary shows the real traceback (never `<N/A>`).

It imports nothing from torch: the script decides what to import, and OMP_NUM_THREADS is already set.
(`--ddp lockstep` works before this module runs: the start-up hook on PYTHONPATH, lockstep/startup.)
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback
from types import TracebackType
from typing import Any

from lockstep.startup import register_lightning_strategy

_BOOTSTRAP_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
_LOCKSTEP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
GOODPUT_FILE = "goodput.json"  # in the rank directory: the run's time account, read by the launcher
PID_FILE = "pid"  # in the rank directory, next to the error file: read by launch/process_sweep.py
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"  # set by torch's agent from launch/rank_logs.py's placement
MEMBER_ID_VAR = (
    "LOCKSTEP_MEMBER_ID"  # runtime/env/env_contract.py's (this bootstrap imports nothing of torch's)
)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m lockstep.launch.worker (script PATH | module NAME) [ARGS...]`."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] not in ("script", "module"):
        sys.stderr.write("usage: python -m lockstep.launch.worker (script PATH | module NAME) [ARGS...]\n")
        sys.exit(
            2
        )  # an exit status for the launcher that started this bootstrap wrongly, not an error to catch
    kind, target, args = argv[0], argv[1], argv[2:]
    error_file = os.environ.get(ERROR_FILE_VAR) or None
    if error_file:
        _write_pid(os.path.dirname(error_file))
    faulthandler.enable(all_threads=True)
    register_lightning_strategy()
    try:
        _run(kind, target, args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _record(error_file, exc, exc.__traceback__, exc.code if isinstance(exc.code, int) else 1)
        elif error_file:
            _write_goodput(os.path.dirname(error_file))
        _exit_if_groups_abandoned(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
        if exc.code in (None, 0):
            _leave_process_group()
        raise
    except BaseException as exc:
        tb = _user_frames(exc.__traceback__)
        # An interrupted worker exits 130 (128 + SIGINT) as a shell would; any other exception exits 1.
        code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
        _record(error_file, exc, tb, code)
        # Default hooks (and torch's rank-prefixing one) print exc.__traceback__, not the tb argument.
        _print_exception(exc.with_traceback(tb), tb)
        sys.stderr.flush()
        _exit_if_groups_abandoned(code)
        sys.exit(code)  # the exit status torch's agent reports; the error itself is in the error file
    if error_file:
        _write_goodput(os.path.dirname(error_file))
    _exit_if_groups_abandoned(0)
    _leave_process_group()


def _print_exception(exc: BaseException, tb: TracebackType | None) -> None:
    """Print `exc` as sys.excepthook would, with one rank prefix. torch's init_process_group wraps
    sys.excepthook in a hook that prefixes every line with `[rank<r>]: ` (its rank in that group), and it
    does so each time: live mode forms one group per generation, so after k re-formations a traceback
    carried k + 1 prefixes, each with another generation's rank. Print through the hook beneath torch's
    wrappers, prefixed once: with the member id in live mode (the name the launcher gives this worker in
    every generation), else with the first group's rank, as torch would."""
    hook, prefix = _beneath_torch_prefixes(sys.excepthook)
    if prefix is None:
        sys.excepthook(type(exc), exc, tb)
        return
    member = os.environ.get(MEMBER_ID_VAR)
    prefix = f"[rank{member}]" if member else prefix
    printed = io.StringIO()
    stderr, sys.stderr = sys.stderr, printed
    try:
        hook(type(exc), exc, tb)
    finally:
        sys.stderr = stderr
    lines = printed.getvalue().split("\n")
    sys.stderr.write("\n".join(f"{prefix}: {line}" if line else "" for line in lines))


def _beneath_torch_prefixes(hook: Any) -> tuple[Any, str | None]:
    """The excepthook under every rank-prefixing wrapper of torch's (torch/distributed/distributed_c10d.py,
    `_distributed_excepthook`, with `old_hook` and `excepthook_prefix` in its closure), and the prefix of
    the innermost one (None when `hook` is not torch's)."""
    prefix = None
    while getattr(hook, "__name__", "") == "_distributed_excepthook":
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or (), strict=False))
        if "old_hook" not in cells or "excepthook_prefix" not in cells:
            break
        prefix = str(cells["excepthook_prefix"].cell_contents)
        hook = cells["old_hook"].cell_contents
    return hook, prefix


def _leave_process_group() -> None:
    """Destroy the process group a finished script left open, before the interpreter's teardown (where
    gloo's threads outliving their group abort the process now and then). Read from sys.modules: this
    bootstrap imports nothing of torch's itself."""
    process_group = sys.modules.get("lockstep.runtime.process_group")
    dist = sys.modules.get("torch.distributed")
    try:
        if process_group is not None:
            process_group.shutdown()  # also stops lockstep's hang watchdog
        elif dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # the script succeeded: its exit status stays 0, the reason goes to the log
        sys.stderr.write(f"lockstep run: the process group could not be destroyed at exit: {exc!r}\n")


def _exit_if_groups_abandoned(code: int) -> None:
    """Live mode left groups with work stuck in them (runtime/membership/formation.py): the interpreter's
    teardown would wait for that work to time out, so leave now, after the group of this generation and
    the output. Read from sys.modules: this bootstrap imports nothing of torch's itself."""
    process_group = sys.modules.get("lockstep.runtime.process_group")
    if process_group is None:
        return
    group = process_group.live_group()
    if group is None or not group.abandoned:
        return
    process_group.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(kind: str, target: str, args: list[str]) -> None:
    if kind == "module":
        sys.argv = [target, *args]  # run_module replaces argv[0] with the module's file, as `python -m` does
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    # `python PATH` puts the script's directory first on sys.path (here it is the launch directory).
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")


def _call_site(tb: TracebackType | None) -> str | None:
    """Where the program called into lockstep, when the exception was raised inside lockstep: the
    innermost frame outside it (a framework's `model.reducer...`), which a long traceback buries."""
    frames = traceback.extract_tb(tb)
    if not frames or not os.path.abspath(frames[-1].filename).startswith(_LOCKSTEP_DIR):
        return None
    for frame in reversed(frames):
        if not os.path.abspath(frame.filename).startswith(_LOCKSTEP_DIR):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return None


def _write_goodput(directory: str) -> None:
    """After a program that ended well: the run's time account as lockstep's engine, fit or LiveLoop kept it
    (runtime/run_account.py), in GOODPUT_FILE for the launcher's last line; nothing when the program never
    loaded lockstep's runtime or never stepped. Best effort: the program's result stands either way."""
    module = sys.modules.get("lockstep.runtime.run_account")
    if module is None:
        return
    try:
        summary = module.goodput()
        if summary.get("goodput") is not None:
            with open(os.path.join(directory, GOODPUT_FILE), "w") as fh:
                json.dump(summary, fh)
    except Exception:  # noqa: BLE001 (a report on the side must never fail the run it reports on)
        pass


def _write_pid(directory: str) -> None:
    try:
        with open(os.path.join(directory, PID_FILE), "w") as fh:
            fh.write(f"{os.getpid()}\n")
    except OSError:
        pass  # best effort: the agent still stops this worker; only the final sweep loses its target


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop the bootstrap's and runpy's frames from the top of a traceback: the user never wrote them."""
    head = tb
    while head is not None and _is_bootstrap(head.tb_frame.f_code.co_filename):
        head = head.tb_next
    return head if head is not None else tb


def _is_bootstrap(filename: str) -> bool:
    return filename.startswith("<frozen runpy") or os.path.abspath(filename) in _BOOTSTRAP_FILES


def _record(error_file: str | None, exc: BaseException, tb: TracebackType | None, exitcode: int) -> None:
    """Write the failure where torch's agent looks for it (ProcessFailure reads this JSON), with the exit code
    this worker is about to exit with: if the agent stops it while it is still exiting (its peers failed
    meanwhile), the launcher still reports the code it chose, not the agent's SIGTERM."""
    if not error_file:
        return
    if isinstance(exc, SystemExit):
        message = f"SystemExit: {exc.code!r} (the script called sys.exit({exc.code!r}))"
    else:
        message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    now = time.time()
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, _user_frames(tb))),
                "timestamp": str(int(now)),
                # Sub-second time of failure: picks the first failing rank when several fail in one second.
                "lockstep_time": now,
                "lockstep_exitcode": exitcode,
                "lockstep_call_site": _call_site(tb),
            },
        }
    }
    # Whole or not at all: torch's agent reads this file as soon as it sees the worker gone, and a peer's
    # death can make it look while this worker is still writing (a half-written file crashed the agent).
    tmp = f"{error_file}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, error_file)
    except OSError:
        pass


if __name__ == "__main__":
    main()
