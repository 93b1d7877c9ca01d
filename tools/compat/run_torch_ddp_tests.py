"""torch's own DDP tests as lockstep's oracle: run them on torch's DDP and on lockstep's, write a table.

The tests are those of `DistributedTest._DistTestBase` in the torch wheel
(torch/testing/_internal/distributed/distributed_test.py), run as torch's test_distributed_spawn.py runs
them (gloo, WORLD_SIZE=2, one spawned process per rank), through compat_cases.py, which swaps the engine's
class in for the names the tests use. Selected: the tests whose name contains `ddp` or
`DistributedDataParallel` (any case), and the other tests whose body, or a `self._helper` it calls
(transitively), names DistributedDataParallel.

    .venv/bin/python tools/compat/run_torch_ddp_tests.py                    # both engines, every selected test
    .venv/bin/python tools/compat/run_torch_ddp_tests.py --reuse-baseline   # torch's column from docs/compat
    .venv/bin/python tools/compat/run_torch_ddp_tests.py --only no_sync --engine lockstep

Writes docs/compat/torch_ddp_tests.md and .json (or, with --only, build/compat/), and one log per test
and engine under build/compat/logs/. Exit status: 0 when every test that passes on torch passes on
lockstep or is on the allow-list (internals.txt: tests that read torch's private internals), 1 when
some do not (they are printed), 2 when the harness itself fails (the swap probe, say).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import inspect
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "worker.py"
ALLOW_LIST = HERE / "internals.txt"
DOCS_DIR = ROOT / "docs" / "compat"
BUILD_DIR = ROOT / "build" / "compat"
STEM = "torch_ddp_tests"
ENGINES = ("torch", "lockstep")
PROBE = "test_compat_swap_probe"
NAME_PATTERN = re.compile(r"ddp|distributeddataparallel", re.IGNORECASE)
HELPER_CALL = re.compile(r"self\.(_\w+)\(")
WORKER_START_TIMEOUT_S = 300.0  # importing torch's test modules on a loaded 2-core machine

Record = dict[str, Any]


class HarnessError(Exception):
    """The harness itself failed (a worker that does not start, a swap probe that fails): exit status 2."""


# ---------------------------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Selected:
    name: str
    selected_by: str  # "name", "body" or "helper:<the self._helper through which it reaches DDP>"


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError):
        return ""


def select_tests(base: type) -> list[Selected]:
    """The DDP tests of `base` (torch's _DistTestBase), in name order, each with why it was selected."""

    def helper_naming_ddp(name: str, seen: set[str]) -> str | None:
        """The first `self._helper` called from `name` that names DistributedDataParallel, itself or below."""
        seen.add(name)
        for helper in sorted(set(HELPER_CALL.findall(_source(getattr(base, name))))):
            if helper in seen or not callable(getattr(base, helper, None)):
                continue
            if "DistributedDataParallel" in _source(getattr(base, helper)) or helper_naming_ddp(helper, seen):
                return helper
        return None

    selected = []
    for name in sorted(n for n in dir(base) if n.startswith("test") and callable(getattr(base, n))):
        if NAME_PATTERN.search(name):
            selected.append(Selected(name, "name"))
        elif "DistributedDataParallel" in _source(getattr(base, name)):
            selected.append(Selected(name, "body"))
        elif helper := helper_naming_ddp(name, set()):
            selected.append(Selected(name, f"helper:{helper}"))
    return selected


def load_allow_list(path: Path = ALLOW_LIST) -> dict[str, str]:
    """internals.txt: `test_name: reason` lines; `#` starts a comment."""
    allowed: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip() if raw.lstrip().startswith("#") else raw.strip()
        if not line:
            continue
        name, sep, reason = line.partition(":")
        if not sep or not name.strip().startswith("test") or not reason.strip():
            raise SystemExit(f"{path}:{lineno}: expected `test_name: reason`, got {raw!r}")
        allowed[name.strip()] = reason.strip()
    return allowed


# ------------------------------------------------------------------------------------------------ workers


class Worker:
    """A worker.py process for one engine, in its own process group so that a hang can be killed whole."""

    def __init__(self, engine: str, log_dir: Path, inner_timeout: int, tag: str) -> None:
        self.engine, self.log_dir, self.inner_timeout, self.tag = engine, log_dir, inner_timeout, tag
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.engine_class = ""

    def start(self) -> None:
        env = dict(os.environ, COMPAT_ENGINE=self.engine, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        stderr = open(self.log_dir / f"worker-{self.tag}.log", "a", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--inner-timeout", str(self.inner_timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,
        )
        stderr.close()
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self.lines), daemon=True).start()
        ready = self._answer(WORKER_START_TIMEOUT_S)
        if ready is None or not ready.get("ready"):
            self.kill()
            raise HarnessError(
                f"{self.engine} worker did not start; see {self.log_dir}/worker-{self.tag}.log"
            )
        self.engine_class = str(ready["class"])

    @staticmethod
    def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def _answer(self, timeout: float) -> Record | None:
        """The next JSON line, or None on timeout or when the worker has died."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                return None
            if line is None:
                return None
            if line.startswith("{"):
                record: Record = json.loads(line)
                return record

    def run(self, name: str, log_path: Path, timeout: float) -> Record:
        if self.proc is None or self.proc.poll() is not None:
            try:
                self.start()
            except HarnessError as error:
                return {
                    "name": name,
                    "status": "error",
                    "duration_s": 0.0,
                    "reason": str(error),
                    "error_tail": [],
                }
        assert self.proc is not None and self.proc.stdin is not None
        log_path.write_text("", encoding="utf-8")  # this run's output only
        start = time.monotonic()
        self.proc.stdin.write(f"{name}\t{log_path}\n")
        self.proc.stdin.flush()
        record = self._answer(timeout)
        if record is not None:
            return record
        died = self.proc.poll() is not None
        self.kill()
        status, reason = ("error", "worker died") if died else ("timeout", f"killed after {timeout:.0f} s")
        return {
            "name": name,
            "status": status,
            "duration_s": round(time.monotonic() - start, 2),
            "reason": reason,
            "error_tail": _tail_of_file(log_path),
        }

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        """Kill the worker's process group (the worker and the ranks it spawned), by its id."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None


def _tail_of_file(path: Path, lines: int = 15) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.splitlines() if line.strip()][-lines:]


def _shown(path: Path) -> str:
    """`path` relative to the repository when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _log_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".log"


def run_engine(
    engine: str, names: list[str], args: argparse.Namespace, progress: Callable[[str], None]
) -> tuple[dict[str, Record], str, float]:
    """Run `names` on `engine` with args.jobs workers; return the records, the class name, the wall time."""
    log_dir = args.log_dir / engine
    log_dir.mkdir(parents=True, exist_ok=True)
    inner = max(10, int(args.timeout) - 15)
    start = time.monotonic()
    for old_log in log_dir.glob("worker-*.log"):
        old_log.unlink()
    probe_worker = Worker(engine, log_dir, inner, f"{engine}-0")
    probe = probe_worker.run(PROBE, log_dir / _log_name(PROBE), max(args.timeout, 120.0))
    if probe["status"] != "passed":
        probe_worker.kill()
        tail = "\n    ".join(probe.get("error_tail") or [])
        raise HarnessError(
            f"swap probe failed on {engine}: {probe['status']} {probe.get('reason', '')}\n    {tail}"
        )
    engine_class = probe_worker.engine_class
    progress(f"[{engine}] probe passed: the spawned ranks use {engine_class}")

    todo: queue.Queue[str] = queue.Queue()
    for name in names:
        todo.put(name)
    results: dict[str, Record] = {}
    lock = threading.Lock()

    def drain(worker: Worker) -> None:
        try:
            while True:
                try:
                    name = todo.get_nowait()
                except queue.Empty:
                    return
                record = worker.run(name, log_dir / _log_name(name), args.timeout)
                record["log"] = _shown(log_dir / _log_name(name))
                with lock:
                    results[name] = record
                    done = len(results)
                extra = f" ({record['reason']})" if record.get("reason") else ""
                progress(
                    f"[{engine} {done}/{len(names)}] {name}: {record['status']} "
                    f"{record['duration_s']:.1f}s{extra}"
                )
        finally:
            worker.stop()

    workers = [probe_worker] + [Worker(engine, log_dir, inner, f"{engine}-{i}") for i in range(1, args.jobs)]
    threads = [threading.Thread(target=drain, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, engine_class, round(time.monotonic() - start, 1)


# ------------------------------------------------------------------------------------------------ report


def _ok(record: Record | None) -> bool:
    return record is not None and record.get("status") == "passed"


def _ran(record: Record | None) -> bool:
    return record is not None and record.get("status") not in ("skipped", None)


def summarize(rows: list[Record]) -> Record:
    def counts(engine: str) -> dict[str, int]:
        c = Counter(str((row.get(engine) or {}).get("status", "not run")) for row in rows)
        return dict(sorted(c.items()))

    torch_ran = [r for r in rows if _ran(r.get("torch"))]
    torch_pass = [r for r in rows if _ok(r.get("torch"))]
    lockstep_ran = [r for r in rows if _ran(r.get("lockstep"))]
    lockstep_pass = [r for r in rows if _ok(r.get("lockstep"))]
    regressions = [r for r in torch_pass if r.get("lockstep") and not _ok(r["lockstep"])]
    return {
        "selected": len(rows),
        "selected_by": dict(Counter(r["selected_by"].split(":")[0] for r in rows)),
        "torch": {"counts": counts("torch"), "ran_on_cpu": len(torch_ran), "passed": len(torch_pass)},
        "lockstep": {
            "counts": counts("lockstep"),
            "ran_on_cpu": len(lockstep_ran),
            "passed": len(lockstep_pass),
            "passed_of_torch_passes": len(torch_pass) - len(regressions),
        },
        "torch_pass_lockstep_not": [r["name"] for r in regressions],
        "allowed_internals": [r["name"] for r in regressions if r.get("internals")],
        "unexpected": [r["name"] for r in regressions if not r.get("internals")],
        "lockstep_pass_torch_not": [r["name"] for r in lockstep_pass if not _ok(r.get("torch"))],
    }


def _cell(record: Record | None) -> str:
    if record is None:
        return "not run"
    status = str(record["status"])
    shown = {"passed": "pass", "skipped": "skip"}.get(status, f"**{status.upper()}**")
    return shown if status == "skipped" else f"{shown} ({record['duration_s']:.1f} s)"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _last_error_line(record: Record | None) -> str:
    if record is not None and record.get("status") == "timeout" and record.get("reason"):
        return str(record["reason"])
    tail = (record or {}).get("error_tail") or []
    return str(tail[-1]) if tail else str((record or {}).get("reason", ""))


def _note(row: Record) -> str:
    t, ls = row.get("torch"), row.get("lockstep")
    notes = []
    if row.get("internals"):
        notes.append(f"internals: {row['internals']}")
    if _ok(t) and ls is not None and not _ok(ls) and not row.get("internals"):
        notes.append(f"REGRESSION: {_last_error_line(ls)[:200]}")
    elif ls is not None and not _ok(ls) and _ran(ls) and not _ok(t):
        notes.append(f"lockstep: {_last_error_line(ls)[:160]}")
    if _ran(t) and not _ok(t):
        notes.append(f"torch: {_last_error_line(t)[:160]}")
    reasons = {
        str(r.get("reason")) for r in (t, ls) if r and r.get("status") == "skipped" and r.get("reason")
    }
    notes.extend(f"skip: {reason}" for reason in sorted(reasons))
    if _ok(ls) and t is not None and not _ok(t):
        notes.append("lockstep passes where torch does not")
    return _md("; ".join(notes))


def write_markdown(path: Path, meta: Record, summary: Record, rows: list[Record]) -> None:
    t, ls = summary["torch"], summary["lockstep"]
    by = ", ".join(f"{n} by {k}" for k, n in sorted(summary["selected_by"].items()))
    lines = [
        "# torch's DDP tests on lockstep",
        "",
        f"- DDP tests selected: {summary['selected']} ({by}) of `DistributedTest._DistTestBase` in torch "
        f"{meta['torch_version']}, gloo, world size {meta['world_size']}.",
        f"- Run on CPU (not skipped) with torch's DDP: {t['ran_on_cpu']}; with lockstep's: {ls['ran_on_cpu']}.",
        f"- Pass with torch's DDP: {t['passed']}; with lockstep's: {ls['passed']} "
        f"({ls['passed_of_torch_passes']} of torch's {t['passed']} passes).",
        f"- Pass on torch, not on lockstep: {len(summary['torch_pass_lockstep_not'])} "
        f"({len(summary['allowed_internals'])} allow-listed as reading torch internals, "
        f"{len(summary['unexpected'])} not).",
        f"- torch: {_counts_text(t['counts'])}. lockstep: {_counts_text(ls['counts'])}.",
        "",
        f"Generated {meta['generated']} by `{meta['command']}` (lockstep at {meta['lockstep_commit']}, "
        f"sources {meta['lockstep_sources']}"
        + (", CHANGED during the run" if meta["lockstep_changed_during_run"] else "")
        + "; "
        f"classes: torch `{meta['engines'].get('torch', {}).get('class', '-')}`, lockstep "
        f"`{meta['engines'].get('lockstep', {}).get('class', '-')}`; hard timeout {meta['timeout_s']} s per test; "
        f"wall time: {_walls(meta)}). The torch column is "
        + (
            "reused from an earlier run (`--reuse-baseline`)."
            if meta.get("baseline_reused")
            else "from this run."
        )
        + " Regenerate with `make compat`; see tools/compat/README.md.",
        "",
        "| test | torch | lockstep | note |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| `{row['name']}` | {_cell(row.get('torch'))} | {_cell(row.get('lockstep'))} | {_note(row)} |"
        )
    failing = [r for r in rows if r["name"] in summary["torch_pass_lockstep_not"]]
    if failing:
        lines += ["", "## Pass on torch, fail on lockstep", ""]
        for row in failing:
            tag = f" (allow-listed: {row['internals']})" if row.get("internals") else ""
            lines += [
                f"### `{row['name']}`{tag}",
                "",
                "```text",
                *row["lockstep"].get("error_tail", []),
                "```",
                "",
            ]
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {status}" for status, n in counts.items()) or "not run"


def _walls(meta: Record) -> str:
    return ", ".join(f"{e} {v.get('wall_s', 0):.0f} s" for e, v in meta["engines"].items())


# ------------------------------------------------------------------------------------------------ main


def lockstep_fingerprint() -> str:
    """A hash of lockstep's sources as they are on disk: the ranks import the working tree, not a commit."""
    digest = hashlib.sha1()
    for path in sorted((ROOT / "src" / "lockstep").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _lockstep_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=(*ENGINES, "both"), default="both")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run the selected tests whose name matches this regex (repeatable)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="tests at a time (keep 1 on a 2-core machine)")
    parser.add_argument("--timeout", type=float, default=120.0, help="hard timeout per test, seconds")
    parser.add_argument(
        "--reuse-baseline",
        action="store_true",
        help="take torch's results from --baseline instead of running them",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=DOCS_DIR / f"{STEM}.json",
        help="the JSON that --reuse-baseline reads (default: the committed table's)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help=f"default {DOCS_DIR.relative_to(ROOT)}, or {BUILD_DIR.relative_to(ROOT)} with --only",
    )
    parser.add_argument("--log-dir", type=Path, default=BUILD_DIR / "logs")
    parser.add_argument("--list", action="store_true", help="print the selected tests and exit")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.out_dir is None:
        args.out_dir = BUILD_DIR if args.only else DOCS_DIR
    args.out_dir, args.log_dir, args.baseline = (
        args.out_dir.resolve(),
        args.log_dir.resolve(),
        args.baseline.resolve(),
    )
    return args


def main(argv: Iterable[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.environ["COMPAT_ENGINE"] = "torch"  # the driver only reads the test class; the swap is the workers'
    sys.path.insert(0, str(HERE))
    import compat_cases
    import torch

    every = select_tests(compat_cases.DistributedTest._DistTestBase)
    selected = [s for s in every if not args.only or any(re.search(p, s.name) for p in args.only)]
    allowed = load_allow_list()
    unknown = sorted(set(allowed) - {s.name for s in every})
    if unknown:
        print(f"warning: allow-listed but not selected: {', '.join(unknown)}", file=sys.stderr)
    if args.list:
        for s in selected:
            print(f"{s.name}\t{s.selected_by}")
        return 0
    if not selected:
        print("no test selected", file=sys.stderr)
        return 2
    names = [s.name for s in selected]

    json_path, md_path = args.out_dir / f"{STEM}.json", args.out_dir / f"{STEM}.md"
    baseline: dict[str, Record] = {}
    meta_engines: dict[str, Record] = {}
    if args.reuse_baseline:
        if not args.baseline.is_file():
            raise SystemExit(f"--reuse-baseline: no {args.baseline}; run without it once")
        old = json.loads(args.baseline.read_text(encoding="utf-8"))
        if old["meta"]["torch_version"] != torch.__version__:
            raise SystemExit(
                f"baseline in {args.baseline} is for torch {old['meta']['torch_version']}, "
                f"this is {torch.__version__}: run without --reuse-baseline"
            )
        baseline = {row["name"]: row["torch"] for row in old["tests"] if row.get("torch")}
        meta_engines["torch"] = dict(old["meta"]["engines"]["torch"], reused=True)

    def progress(text: str) -> None:
        print(text, flush=True)

    engines = ENGINES if args.engine == "both" else (args.engine,)
    results: dict[str, dict[str, Record]] = {}
    lockstep_version: tuple[str, str, bool] = (_lockstep_commit(), lockstep_fingerprint(), False)
    for engine in engines:
        todo = names
        if engine == "torch" and args.reuse_baseline:
            todo = [n for n in names if n not in baseline]
            results["torch"] = {n: baseline[n] for n in names if n in baseline}
            progress(f"[torch] reusing {len(results['torch'])} baseline results; running {len(todo)}")
            if not todo:
                continue
        version = (_lockstep_commit(), lockstep_fingerprint())
        try:
            records, engine_class, wall = run_engine(engine, todo, args, progress)
        except HarnessError as error:
            print(f"harness error: {error}", file=sys.stderr)
            return 2
        if engine == "lockstep":
            lockstep_version = (*version, version != (_lockstep_commit(), lockstep_fingerprint()))
        results.setdefault(engine, {}).update(records)
        meta_engines[engine] = {"class": engine_class, "wall_s": wall, "tests_run": len(todo)}

    rows: list[Record] = []
    for s in selected:
        row: Record = {"name": s.name, "selected_by": s.selected_by, "internals": allowed.get(s.name)}
        for engine in ENGINES:
            if s.name in results.get(engine, {}):
                row[engine] = results[engine][s.name]
        rows.append(row)
    summary = summarize(rows)
    meta = {
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["tools/compat/run_torch_ddp_tests.py", *argv]),
        "torch_version": torch.__version__,
        "lockstep_commit": lockstep_version[0],
        "lockstep_sources": lockstep_version[1],
        "lockstep_changed_during_run": lockstep_version[2],
        "backend": os.environ["BACKEND"],
        "world_size": int(os.environ["WORLD_SIZE"]),
        "timeout_s": args.timeout,
        "jobs": args.jobs,
        "only": args.only,
        "baseline_reused": bool(args.reuse_baseline),
        "engines": meta_engines,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path.write_text(
        json.dumps({"meta": meta, "summary": summary, "tests": rows}, indent=1) + "\n", encoding="utf-8"
    )
    write_markdown(md_path, meta, summary, rows)

    if meta["lockstep_changed_during_run"]:
        print(
            "warning: lockstep's sources changed during the run; the lockstep column mixes versions",
            file=sys.stderr,
        )
    t, ls = summary["torch"], summary["lockstep"]
    print(
        f"\nselected {summary['selected']}; ran on CPU: torch {t['ran_on_cpu']}, lockstep {ls['ran_on_cpu']}; "
        f"passed: torch {t['passed']}, lockstep {ls['passed']}; wall: {_walls(meta)}"
    )
    print(f"wrote {_shown(md_path)} and .json")
    if summary["allowed_internals"]:
        print(
            f"allow-listed (torch internals), failing on lockstep: {', '.join(summary['allowed_internals'])}"
        )
    passing_allowed = [r["name"] for r in rows if r.get("internals") and _ok(r.get("lockstep"))]
    if passing_allowed:
        print(f"note: allow-listed but passing on lockstep: {', '.join(passing_allowed)}")
    if summary["unexpected"]:
        print(
            f"\n{len(summary['unexpected'])} test(s) pass on torch and fail on lockstep (not allow-listed):"
        )
        for name in summary["unexpected"]:
            record = results["lockstep"][name]
            print(f"  {name}: {record['status']}: {_last_error_line(record)[:200]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
