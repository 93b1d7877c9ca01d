"""Benchmark: goodput at one fault a minute, live mode against whole-job restarts (issue 47).

The gpt job on 4 ranks (`lockstep train gpt -n 4 --deterministic --global-batch-size 64
--micro-batch-size 8 --checkpoint-every K --checkpoint-async true --max-steps N`), three runs one after
the other, all of the same N steps:

1. fault-free, with the live flags (`--min-world 2 --max-restarts 40 --hang-timeout 5 --evict-stragglers
   3`) and no fault: its wall time, goodput and final bits;
2. live: the same flags, one fault every --every-s seconds (each gap drawn uniformly from 5/6 to 7/6 of
   it), kinds in turn kill, stop, straggler, checkpoint_rank0 (tools/chaos.py's Striker: SIGKILL a member,
   SIGSTOP one, throttle one to 10% of a core until rank 0 evicts it, SIGKILL rank 0 while its background
   checkpoint write is in flight); every lost member is replaced;
3. restarts: `--max-restarts 40 --hang-timeout 5` without --min-world (a fault ends the attempt and the
   launcher restarts every worker from the last checkpoint), struck by the same schedule at the same times
   after the first step. The workers are found by their pid files (`<run_dir>[/restart<k>]/rank<R>/pid`):
   kill SIGKILLs one, stop SIGSTOPs one (the hang watchdog ends the attempt), straggler throttles one
   like chaos does until the next fault is due (at most 60 s: without live mode nothing evicts it, the
   job runs at its pace), checkpoint_rank0 SIGKILLs rank 0 while a checkpoint write is in flight.

Each run's summary.json gives the goodput (the time of the steps that counted over the wall time from the
first step to the last), the time lost by cause and the samples lost. The report has a table of the runs
and one of the time lost by cause, one row per run. Target (issue 47): live goodput >= 0.97 at one fault
a minute, no sample lost, the fault-free run's bits.

The straggler kind needs root and cgroup v1's cpu controller (/sys/fs/cgroup/cpu); elsewhere its strikes
are skipped and the report says so.

--duration-min D picks N from a short fault-free run's rate (its steps over the time from its first step
to its last) so the fault-free run trains for about D minutes and a faulted one for longer; --steps N
takes N as given.

    OMP_NUM_THREADS=1 python benchmarks/goodput.py --duration-min 20 --every-s 60 \\
        --report benchmarks/results/2026-11-29-goodput.md --json goodput.json
    OMP_NUM_THREADS=1 python benchmarks/goodput.py --quick    # the harness end to end in ~12 minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import chaos  # noqa: E402
from benchmarks.common import machine_line  # noqa: E402

GPT_ARGS = ("--global-batch-size", "64", "--micro-batch-size", "8", "--epochs", "1000")
KINDS = ("kill", "stop", "straggler", "checkpoint_rank0")
RUN_NAMES = ("fault-free", "live", "restarts")
REPLACEMENTS = 40
PROBE_STEPS = 400  # the fault-free run that --duration-min sizes N from
CAUSES = (
    "reformation",
    "redone_work",
    "hang_detection",
    "state_transfer",
    "checkpoint_stall",
    "restart",
    "evaluation",
)


@dataclass
class Run:
    name: str
    folder: Path
    flags: str
    exit_code: int | None
    wall_s: float  # launch to exit
    summary: dict[str, Any] = field(repr=False)
    strikes: list[chaos.Strike] = field(default_factory=list)
    same_bits: bool = False
    recorded: str = "-"  # how the faults struck show in the record
    why: str = ""
    steps_undone: int | None = (
        None  # restarts: from the launcher's lines (a lower bound: a line every 10 steps)
    )
    restarts: int | None = None  # whole-job restarts: the launcher's restart<k> folders (summary.json's
    # `restarts` counts live mode's only)

    def get(self, key: str) -> Any:
        return self.summary.get(key)


def settings(
    steps: int, live: bool, checkpoint_every: int, timeout_s: float, eval_every: int = 0
) -> chaos.Settings:
    return chaos.Settings(
        steps=steps,
        replacements=REPLACEMENTS,
        timeout_s=timeout_s,
        job="gpt",
        job_args=(*GPT_ARGS, "--eval-every", str(eval_every)),
        checkpoint_every=checkpoint_every,
        live=live,
    )


def plan(seed: int, every_s: float, count: int) -> list[tuple[float, str]]:
    """(seconds after the first step, kind) of each fault: gaps drawn from 5/6 to 7/6 of every_s, kinds
    in turn."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for i in range(count):
        at += rng.uniform(every_s * 5 / 6, every_s * 7 / 6)
        out.append((round(at, 2), KINDS[i % len(KINDS)]))
    return out


class RestartJob(chaos.Job):
    """A job without live mode: no live store; its workers are those of the newest attempt's folder."""

    def attempts(self) -> list[Path]:
        """Every attempt's folder, oldest first: the run directory, then restart1, restart2, ..."""
        later = [p for p in self.run_dir.glob("restart*") if p.name[7:].isdigit()]
        return [self.run_dir, *sorted(later, key=lambda p: int(p.name[7:]))]

    def newest(self) -> Path:
        return self.attempts()[-1]

    def pid(self, member: int) -> int | None:
        return _read_pid(self.newest() / f"rank{member}" / "pid")

    def pids(self) -> list[int]:
        """The workers of every attempt."""
        found = (_read_pid(p) for a in self.attempts() for p in a.glob("rank*/pid"))
        return [pid for pid in found if pid is not None]

    def alive(self, member: int) -> bool:
        pid = self.pid(member)
        return pid is not None and _running(pid)

    def stop(self) -> None:
        for pid in self.pids():
            chaos._signal(pid, signal.SIGCONT)
        super().stop()
        for pid in self.pids():
            chaos._signal(pid, signal.SIGKILL)


class RestartStriker:
    """Strikes at the newest attempt's workers once all of them run and it trains (metrics.jsonl written
    since they all started): a fault while an attempt starts would only hit what the last one left."""

    def __init__(self, job: RestartJob, rng: random.Random) -> None:
        self.job, self.rng = job, rng
        self.release_at = math.inf  # job.elapsed() when the next fault is due: a straggler's throttle ends

    def ready(self, wait_s: float = 180.0) -> list[int] | None:
        deadline = time.monotonic() + wait_s
        metrics = self.job.run_dir / "metrics.jsonl"
        seen: tuple[Path, float] | None = None
        while time.monotonic() < deadline and self.job.running():
            attempt = self.job.newest()
            if all(self.job.alive(m) for m in range(chaos.LAUNCHED)):
                if seen is None or seen[0] != attempt:
                    seen = (attempt, time.time())
                elif metrics.exists() and metrics.stat().st_mtime > seen[1]:
                    return list(range(chaos.LAUNCHED))
            else:
                seen = None
            time.sleep(0.05)
        return None

    def strike(self, kind: str) -> chaos.Strike:
        strike = chaos.Strike(kind, round(self.job.elapsed(), 2))
        members = self.ready()
        if members is None:
            strike.note = "skipped: the attempt did not train"
            return strike
        strike.at_s = round(self.job.elapsed(), 2)
        getattr(self, kind)(strike, members)
        return strike

    def _signal(self, strike: chaos.Strike, member: int, sig: int) -> None:
        if self.job.signal(member, sig):
            strike.hit(member, self.job)

    def kill(self, strike: chaos.Strike, members: list[int]) -> None:
        self._signal(strike, self.rng.choice(members), signal.SIGKILL)

    def stop(self, strike: chaos.Strike, members: list[int]) -> None:
        self._signal(strike, self.rng.choice(members), signal.SIGSTOP)

    def checkpoint_rank0(self, strike: chaos.Strike, members: list[int]) -> None:
        if _checkpoint_write(self.job):
            self._signal(strike, 0, signal.SIGKILL)
        else:
            strike.note = "no background checkpoint write seen"

    def straggler(self, strike: chaos.Strike, members: list[int]) -> None:
        """chaos's throttle (10% of a core) on one worker until the next fault is due (at most 60 s), the
        attempt ends or the worker does: nothing evicts it without live mode."""
        victim = self.rng.choice(members[1:])
        pid = self.job.pid(victim)
        if pid is None or not chaos.CPU_CGROUP.is_dir():
            strike.note = "no pid" if pid is None else f"skipped: no cpu cgroup at {chaos.CPU_CGROUP}"
            return
        group = chaos.throttle_group(f"lockstep-goodput-{os.getpid()}")
        try:
            (group / "cgroup.procs").write_text(str(pid))
            strike.hit(victim, self.job)
            until = min(self.release_at - 1.0, self.job.elapsed() + 60.0)
            while self.job.elapsed() < until and self.job.running() and self.job.pid(victim) == pid:
                if not _running(pid):
                    break
                time.sleep(0.1)
            strike.note = f"throttled {self.job.elapsed() - strike.hits_s[-1]:.0f} s"
        except OSError:  # it ended meanwhile
            pass
        finally:
            chaos._release(group)


class LiveStriker(chaos.Striker):
    """chaos's, but checkpoint_rank0 waits longer for a write (a checkpoint every --checkpoint-every steps
    of the gpt job is tens of seconds apart) and sees the whole write, not only its last file."""

    def checkpoint_rank0(self, strike: chaos.Strike, members: list[int]) -> None:
        if _checkpoint_write(self.job):
            self._kill(strike, min(self.job.members()))
        else:
            strike.note = "no background checkpoint write seen"


def _checkpoint_write(job: chaos.Job, wait_s: float = 90.0) -> bool:
    """Whether a checkpoint write started within wait_s: a new temp directory (`.tmp-step_...`, where the
    files go before the step directory is published) or a file being written (`.NAME.partial`)."""
    folder = job.run_dir / "checkpoints"
    before = _writes(folder)  # a crashed save's temp directory stays until the next save starts
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and job.running():
        if _writes(folder) - before:
            return True
        time.sleep(0.003)
    return False


def _writes(folder: Path) -> set[str]:
    try:
        return {p.name for p in folder.iterdir() if p.name.startswith(".tmp-") or p.name.endswith(".partial")}
    except OSError:
        return set()


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _running(pid: int) -> bool:
    """Neither gone nor a zombie nor stopped."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] not in ("Z", "X", "T", "t")
    except OSError:
        return False


def strike_all(job: chaos.Job, striker: Any, faults: list[tuple[float, str]], strikes: list) -> None:
    """Each fault at its time after the first step (a fault whose time passed while an earlier one was
    struck goes at once); until the job ends."""
    if isinstance(striker, chaos.Striker):
        striker.healthy(chaos.LAUNCHED, wait_s=60)
    chaos._wait_for_training(job, deadline=time.monotonic() + 180)
    first_step = job.elapsed()
    for i, (at, kind) in enumerate(faults):
        while job.running() and job.elapsed() < first_step + at:
            time.sleep(0.1)
        if not job.running():
            return
        if isinstance(striker, RestartStriker):
            striker.release_at = first_step + faults[i + 1][0] if i + 1 < len(faults) else math.inf
        try:
            strikes.append(striker.strike(kind))
        except RuntimeError as exc:  # the store went away: the job ended meanwhile
            strikes.append(chaos.Strike(kind, round(job.elapsed(), 2), note=f"store gone: {exc}"[:80]))
            return


def run(name: str, config: chaos.Settings, folder: Path, faults: list[tuple[float, str]], seed: int) -> Run:
    shutil.rmtree(folder, ignore_errors=True)  # never resume an earlier run's checkpoints
    folder.mkdir(parents=True)
    job = chaos.Job(config, folder / "run") if config.live else RestartJob(config, folder / "run")
    strikes: list[chaos.Strike] = []
    why = ""
    print(f"goodput: {name} run started ({config.steps} steps, {len(faults)} faults planned)", flush=True)
    try:
        if faults:
            rng = random.Random(seed * 7919 + 1)
            if not config.live:
                strike_all(job, RestartStriker(job, rng), faults, strikes)  # type: ignore[arg-type]
            elif job.connect(time.monotonic() + 60):
                strike_all(job, LiveStriker(job, rng), faults, strikes)
            else:
                why = "the launcher printed no store address"
        code = job.finish(config.timeout_s - job.elapsed())
    except BaseException:  # Ctrl-C, SIGTERM, a bug of the tool's: the job must not outlive it
        job.stop()
        raise
    wall = job.elapsed()
    summary_file = folder / "run" / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    if code != 0:
        why = why or f"exit code {code}"
    elif not summary:
        why = "no summary.json"
    command = config.command(folder / "run")
    flags = " ".join(command[command.index("-n") + 2 : command.index("--deterministic")])
    restarts = len(job.attempts()) - 1 if isinstance(job, RestartJob) else summary.get("restarts")
    result = Run(name, folder, flags, code, round(wall, 2), summary, strikes, why=why, restarts=restarts)
    print(f"goodput: {name} run ended in {wall:.0f} s (exit {code}) {why}", flush=True)
    return result


def judge(result: Run, reference: Run) -> None:
    """Same bits as the fault-free run; whether every member struck is in the record."""
    keys = ("params_sha256", "optimizer_sha256")
    result.same_bits = bool(result.summary) and all(result.get(k) == reference.get(k) for k in keys)
    hit = [s for s in result.strikes if s.victims]
    if result is reference:
        result.recorded = "-"
    elif "min-world" in result.flags:
        launcher = (result.folder / "launcher.log").read_text(errors="replace")
        ok, missing = chaos._recorded(result.strikes, result.summary, launcher)
        changes = len(result.get("faults") or [])
        members = sum(len(s.victims) for s in hit)
        result.recorded = (
            f"all {members} members struck ({changes} membership changes)" if ok else f"NOT: {missing}"
        )
    else:  # every strike but a throttle ends its attempt: one restart each
        ending = sum(1 for s in hit if s.kind != "straggler")
        result.steps_undone = _undone((result.folder / "launcher.log").read_text(errors="replace"))
        result.recorded = f"{result.restarts} restarts for {ending} attempt-ending faults"


def report(runs: list[Run], args: argparse.Namespace, steps: int, faults: list[tuple[float, str]]) -> str:
    reference = runs[0]
    base_wall = reference.get("goodput_wall_s") if reference.name == "fault-free" else None
    lines = [
        f"# Goodput at one fault every {args.every_s:g} s: live mode against whole-job restarts "
        f"({datetime.date.today()})",
        "",
        machine_line(),
        "",
        f"`lockstep train gpt -n {chaos.LAUNCHED} --deterministic {' '.join(GPT_ARGS)} --max-steps {steps} "
        f"--eval-every {getattr(args, 'eval_every', 0)} "
        f"--checkpoint-every {args.checkpoint_every} --checkpoint-async true`, plus each run's flags. Faults "
        f"(live and restarts: the same schedule, seed {args.seed}): one every {args.every_s * 5 / 6:g}-"
        f"{args.every_s * 7 / 6:g} s after the first step, kinds in turn {', '.join(KINDS)}; "
        f"{'cgroup v1 cpu controller present: stragglers throttled' if _cgroup() else 'NO cpu cgroup: straggler strikes skipped'}.",
        "",
        "| run | flags | exit | wall s | training wall s | steps | goodput | goodput without evaluation "
        "| samples lost | steps undone (launcher's lines) | redos | same bits "
        "| faults struck | recorded | restarts | training time vs fault-free |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        hit = sum(1 for s in r.strikes if s.victims)
        wall = r.get("goodput_wall_s")
        ratio = f"{wall / base_wall:.3f}" if wall and base_wall else "-"
        lines.append(
            f"| {r.name} | `{r.flags}` | {r.exit_code}{f' ({r.why})' if r.why else ''} | {r.wall_s:.1f} | {_value(wall)} | "
            f"{_value(r.get('steps'))} | {_value(r.get('goodput'))} | {_without_evaluation(r)} | "
            f"{_value(r.get('samples_lost'))} | {_value(r.steps_undone)} | "
            f"{_value(r.get('redos'))} | {'yes' if r.same_bits else 'NO'} | {hit} of {len(r.strikes)} | "
            f"{r.recorded} | {_value(r.restarts)} | {ratio} |"
        )
    lines += [
        "",
        "Time lost by cause (summary.json's `lost_s_by_cause`, seconds):",
        "",
        "| run | " + " | ".join(CAUSES) + " | total |",
        "| --- | " + " | ".join("---" for _ in CAUSES) + " | --- |",
    ]
    for r in runs:
        lost = r.get("lost_s_by_cause") or {}
        total = sum(float(v) for v in lost.values())
        lines.append(f"| {r.name} | " + " | ".join(_value(lost.get(c)) for c in CAUSES) + f" | {total:.1f} |")
    live = next((r for r in runs if r.name == "live"), None)
    if live is not None and live.get("goodput") is not None:
        met = live.get("goodput") >= 0.97 and live.get("samples_lost") == 0 and live.same_bits
        lines += [
            "",
            f"Target (live goodput >= 0.97, no sample lost, the fault-free bits): "
            f"**{'met' if met else 'NOT met'}** (goodput {live.get('goodput'):.4f}, "
            f"samples lost {live.get('samples_lost')}, same bits: {'yes' if live.same_bits else 'no'}).",
        ]
    lines += [
        "",
        "Goodput counts a slowed step as a step that counted: a throttled rank slowing every step until it "
        "is evicted (live) or for its whole throttle (restarts: nothing evicts it), a world of 3 while a "
        "replacement starts (its start-up shares the cores) are in no cause of `lost_s_by_cause`; the last "
        "column of the first table (the time from first step to last over the fault-free run's) shows them. "
        f"{_evaluations(args)} (the evaluation cause), so even the fault-free run's "
        "goodput is below 1: the column without evaluation takes that time out of the wall time. Without "
        "live mode a fault's whole cost (the hang timeout, the new processes' start, the load, the work "
        "since the checkpoint) is the restart cause.",
    ]
    lines += ["", "Strikes (seconds after the launch: kind, members hit or why none):", ""]
    for r in (r for r in runs if r.name != "fault-free"):
        struck = "; ".join(f"{s.at_s:.0f} {s.kind}: {s.victims or s.note}" for s in r.strikes)
        lines.append(f"- {r.name}: {struck or 'none'}")
    lines.append(f"- planned (seconds after the first step): {', '.join(f'{a:.0f} {k}' for a, k in faults)}")
    return "\n".join(lines) + "\n"


def _evaluations(args: argparse.Namespace) -> str:
    every = getattr(args, "eval_every", 0)
    if every:
        return f"The runs evaluate every {every} steps"
    return "The gpt job evaluates at the end of every epoch (every 62 steps at this batch size)"


def _without_evaluation(r: Run) -> str:
    """Goodput with the evaluations' time (an end-of-epoch evaluation: part of any run) out of the wall time."""
    wall, goodput = r.get("goodput_wall_s"), r.get("goodput")
    evaluation = (r.get("lost_s_by_cause") or {}).get("evaluation", 0.0)
    if not wall or goodput is None or wall <= evaluation:
        return "-"
    return f"{goodput * wall / (wall - evaluation):.4g}"


def _undone(launcher: str) -> int:
    """Steps undone by the restarts: the last step rank 0 logged before each restart less the step the next
    attempt resumed from."""
    undone, last = 0, None
    for line in launcher.splitlines():
        logged = re.search(r"step (\d+)/\d+ ", line)
        resumed = re.search(r"^resumed from step (\d+)", line)
        if logged:
            last = int(logged.group(1))
        elif resumed and last is not None:
            undone += max(0, last - int(resumed.group(1)))
            last = None
    return undone


def _cgroup() -> bool:
    return chaos.CPU_CGROUP.is_dir() and os.geteuid() == 0


def _value(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def size(args: argparse.Namespace, workdir: Path) -> int:
    """N for a fault-free run training --duration-min minutes, from a short fault-free run's rate."""
    probe = run(
        "probe",
        settings(PROBE_STEPS, True, args.checkpoint_every, 600.0),
        workdir / "probe",
        [],
        args.seed,
    )
    if probe.why or not probe.get("goodput_wall_s"):
        raise SystemExit(f"goodput: the probe run failed: {probe.why}")
    rate = probe.get("steps") / probe.get("goodput_wall_s")
    steps = int(math.ceil(rate * args.duration_min * 60 / 100) * 100)
    print(f"goodput: {rate:.2f} steps/s fault-free: {steps} steps for {args.duration_min:g} min", flush=True)
    return steps


def _kept(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("every_s", "seed", "checkpoint_every", "duration_min", "eval_every")
    return {k: getattr(args, k, 0) for k in keys}


def _earlier_reference(workdir: Path) -> Run:
    """The fault-free run of an earlier invocation in the same work directory (--runs without it)."""
    path = workdir / "fault-free" / "run" / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    return Run("fault-free", path.parent.parent, "", 0, 0.0, summary)


def render(args: argparse.Namespace) -> str:
    """The report of an earlier run, from its --json."""
    data = json.loads(args.render.read_text())
    for key, value in data.get("settings", {}).items():
        setattr(args, key, value)
    runs = []
    for row in data["runs"]:
        row.pop("folder")
        strikes = [chaos.Strike(**s) for s in row.pop("strikes")]
        runs.append(Run(folder=Path(), strikes=strikes, **row))
    return report(runs, args, data["steps"], [tuple(f) for f in data["faults"]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=None, help="N (default: from --duration-min)")
    parser.add_argument("--duration-min", type=float, default=20.0, help="minutes of fault-free training")
    parser.add_argument("--every-s", type=float, default=60.0, help="seconds between faults (mean)")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0, help="the schedule's seed")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="steps between evaluations (0: the job's, every epoch)"
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=RUN_NAMES,
        default=list(RUN_NAMES),
        help="which runs (default: all three)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown here too")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--render", type=Path, default=None, help="only write the report from an earlier run's --json"
    )
    parser.add_argument(
        "--quick", action="store_true", help="check the harness: 3 minutes, a fault every 30 s"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.duration_min, args.every_s = 3.0, 30.0
    if args.render is not None:
        text = render(args)
        (args.report or Path("/dev/stdout")).write_text(text)
        return 0
    # SIGTERM (a shell's kill): leave through the exception path, which stops the job
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(128 + signal.SIGTERM))
    os.environ["OMP_NUM_THREADS"] = "1"
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lockstep-goodput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    steps = args.steps or size(args, workdir)
    # faults for twice the planned time (a faulted run is slower); the job's end ends the schedule
    faults = plan(args.seed, args.every_s, int(2 * args.duration_min * 60 / args.every_s) + 2)
    timeout = 4 * args.duration_min * 60 + 900
    runs: list[Run] = []
    for name in RUN_NAMES:
        if name not in args.runs:
            continue
        config = settings(steps, name != "restarts", args.checkpoint_every, timeout, args.eval_every)
        result = run(name, config, workdir / name, [] if name == "fault-free" else faults, args.seed)
        runs.append(result)
        judge(result, runs[0] if runs[0].name == "fault-free" else _earlier_reference(workdir))
        text = report(runs, args, steps, faults)  # after every run: a benchmark cut short keeps its runs
        if args.report:
            args.report.write_text(text)
        if args.json:
            rows = [
                {**asdict(r), "summary": {k: v for k, v in r.summary.items() if k != "config"}} for r in runs
            ]
            args.json.write_text(
                json.dumps(
                    {"steps": steps, "settings": _kept(args), "faults": faults, "runs": rows},
                    indent=1,
                    default=str,
                )
            )
    print(text)
    return 0 if all(not r.why for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
