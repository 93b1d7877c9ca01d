"""One engine's test runner: reads test names on stdin, runs each, answers one JSON line per test.

Started by run_torch_ddp_tests.py with COMPAT_ENGINE set; it imports compat_cases once (torch's test
module, the engine swap) and then runs the tests one at a time, each as its own unittest suite, so the
import cost is paid once per worker rather than once per test. While a test runs, file descriptors 1
and 2 go to that test's log file (the spawned ranks inherit them); the answers go to the stdout the
worker was started with. The driver enforces the hard timeout by killing the worker's process group.

Protocol: a line `TEST_NAME<TAB>LOG_PATH` in; a line of JSON out:
{"name", "status", "duration_s", "reason", "error_tail"}, status one of passed, failed, error, skipped,
timeout. A line `quit` ends the worker.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import time
import traceback
import unittest
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

# Failures print the whole child traceback already; the repro hint adds nothing here.
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")

ERROR_TAIL_LINES = 15
_CHILD_SPLIT = re.compile(r"^Process \d+ exited with error code \d+ and exception:$", re.M)
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)|[\w.]*AssertionError)\b")


@contextmanager
def redirect_fds(path: str) -> Iterator[None]:
    """Send fds 1 and 2 (and sys.stdout/err) to `path` for the duration; spawned ranks inherit them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a", encoding="utf-8") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def error_tail(text: str, lines: int = ERROR_TAIL_LINES) -> list[str]:
    """The last lines of the first failing rank's traceback (or of the parent's, when no rank failed)."""
    parts = _CHILD_SPLIT.split(text)
    body = parts[1] if len(parts) > 1 else text
    kept = [line.rstrip() for line in body.strip().splitlines() if line.strip()]
    return kept[-lines:]


def classify(text: str, is_failure: bool) -> str:
    """failed (an assertion of the test), timeout, or error (any other exception)."""
    if "terminated or timed out" in text or "Timing out after" in text:
        return "timeout"
    if is_failure:
        return "failed"
    parts = _CHILD_SPLIT.split(text)
    body = parts[1] if len(parts) > 1 else text
    exc_lines = [line for line in body.splitlines() if _EXC_LINE.match(line.strip())]
    if exc_lines and "AssertionError" in exc_lines[-1].split(":")[0]:
        return "failed"
    return "error"


def run_one(case_class: type, name: str) -> dict[str, Any]:
    """Run `case_class(name)` as a one-test suite; return its result record."""
    result = unittest.TestResult()
    start = time.monotonic()
    try:
        suite = unittest.TestSuite([case_class(name)])
        suite.run(result)
    except BaseException:  # a test that raises SystemExit or the like in the parent
        text = traceback.format_exc()
        return {
            "name": name,
            "status": "error",
            "duration_s": round(time.monotonic() - start, 2),
            "reason": "",
            "error_tail": error_tail(text),
        }
    duration = round(time.monotonic() - start, 2)
    record: dict[str, Any] = {
        "name": name,
        "status": "passed",
        "duration_s": duration,
        "reason": "",
        "error_tail": [],
    }
    if result.skipped:
        record.update(status="skipped", reason=str(result.skipped[0][1]))
    elif result.failures or result.errors:
        is_failure = bool(result.failures)
        text = (result.failures or result.errors)[0][1]
        record.update(status=classify(text, is_failure), error_tail=error_tail(text))
    elif result.unexpectedSuccesses:
        record.update(status="failed", reason="unexpected success")
    elif result.expectedFailures:
        record.update(status="passed", reason="expected failure")
    if record["status"] != "passed" and result.testsRun == 0:
        record["reason"] = record["reason"] or "not run"
    return record


def serve(inp: TextIO, out: TextIO, inner_timeout: int) -> None:
    import compat_cases

    compat_cases.set_inner_timeout(inner_timeout)
    out.write(
        json.dumps({"ready": True, "engine": compat_cases.ENGINE, "class": compat_cases.describe_engine()})
        + "\n"
    )
    out.flush()
    for line in inp:
        line = line.rstrip("\n")
        if not line or line == "quit":
            break
        name, _, log_path = line.partition("\t")
        with redirect_fds(log_path or os.devnull):
            print(f"=== {name} (engine {compat_cases.ENGINE}: {compat_cases.describe_engine()})", flush=True)
            record = run_one(compat_cases.CompatDistBackend, name)
            print(f"=== {name}: {record['status']} in {record['duration_s']} s", flush=True)
        out.write(json.dumps(record) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--inner-timeout", type=int, default=105, help="MultiProcessTestCase's own timeout per test, seconds"
    )
    args = parser.parse_args(argv)
    # Answers go on a private duplicate of the original stdout; fd 1 itself is lent to each test's log.
    out = io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), encoding="utf-8", line_buffering=True)
    os.dup2(2, 1)  # stray prints between tests go to the worker's stderr, never into the answers
    serve(sys.stdin, out, args.inner_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
