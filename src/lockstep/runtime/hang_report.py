"""After a hang verdict: every rank's final state joined into one report, written once and printed everywhere.

The rank whose verdict won (runtime/watchdog.py, `verdict` on the store) is the reporter: it publishes
its final state (`final/<rank>`: every thread's stack), collects the others' for a few ticks, writes the
report as JSON in the run directory (under `lockstep run`) and on the store (`report`), and waits for the
others' acknowledgements (`ack/<rank>`), because rank 0 may host the store. Every other rank publishes
its final state, waits for the report and acknowledges it. All keys live under the watchdog's store
prefix (`lockstep/watchdog/`), on the watchdog thread's own store connection.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from lockstep.runtime import stall_verdict


def respond(store: Any, rank: int, final_state: dict[str, Any], wait_s: float) -> dict[str, Any] | None:
    """Another rank reports: publish this rank's final state, wait for the report (None: none came)."""
    store.set(f"final/{rank}", json.dumps(final_state))
    report = _wait_key(store, "report", wait_s)
    store.set(f"ack/{rank}", "1")
    return json.loads(report) if report else None


def collect(
    store: Any,
    rank: int,
    verdict: dict[str, Any],
    final_state: dict[str, Any],
    *,
    wait_s: float,
    report_path: str | None,
) -> dict[str, Any]:
    """This rank reports: join every responding rank's final state into `verdict`, publish it, and wait
    (bounded) until the others have read it. `report_path`: where the JSON goes (None: nowhere)."""
    states = verdict.pop("states")
    store.set(f"final/{rank}", json.dumps(final_state))
    expected = [r for r, s in states.items() if not s.get("silent") and not s.get("exited")]
    deadline = time.monotonic() + wait_s
    finals: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline and len(finals) < len(expected):
        for r in expected:
            if r not in finals and store.check([f"final/{r}"]):
                finals[r] = json.loads(store.get(f"final/{r}"))
        time.sleep(0.05)
    verdict["ranks"] = {str(r): finals.get(r, s) for r, s in sorted(states.items())}
    verdict["path"] = _write_json(report_path, verdict) if report_path else None
    store.set("report", json.dumps(verdict))
    # Rank 0 may host the store (env:// without an agent): stay until the others have read the report.
    _wait_keys(store, [f"ack/{r}" for r in finals if r != rank], wait_s)
    return verdict


def print_report(rank: int, report: dict[str, Any], report_dir: str | None) -> None:
    """Under `lockstep run` (a report directory) one line, since the launcher prints the report once;
    elsewhere the whole report."""
    if report_dir:
        where = report.get("path") or "the launcher's failure summary"
        sys.stderr.write(f"[rank {rank}] lockstep: hang detected: {report.get('summary')} ({where})\n")
    else:
        sys.stderr.write(stall_verdict.format_report(report) + "\n")


def print_local_report(
    rank: int,
    why: str,
    state: dict[str, Any],
    verdict: dict[str, Any] | None,
    waited_s: float,
    timeout: float,
) -> None:
    """No store to agree through: say what this rank alone knows."""
    summary = f"rank {rank} could not reach the c10d store ({why})"
    if verdict is not None:
        summary = f"{verdict.get('summary')} [{summary} to read the full report]"
    else:
        summary += (
            f" after waiting {waited_s:.1f} s; the rank that hosts it (rank 0 without a launcher) may be "
            "stopped or dead"
        )
    report = {
        "kind": (verdict or {}).get("kind", "store unreachable"),
        "timeout": timeout,
        "summary": summary,
        "culprits": (verdict or {}).get("culprits", []),
        "ranks": {str(rank): state},
    }
    sys.stderr.write(stall_verdict.format_report(report) + "\n")


def _write_json(path: str, report: dict[str, Any]) -> str | None:
    try:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def _wait_keys(store: Any, keys: list[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while keys and time.monotonic() < deadline and not store.check(keys):
        time.sleep(0.05)


def _wait_key(store: Any, key: str, seconds: float) -> bytes | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if store.check([key]):
            return bytes(store.get(key))
        time.sleep(0.05)
    return None
