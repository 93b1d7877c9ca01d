"""Chaos schedules for live mode: seeded faults of every kind over a real run, checked against a fault-free run.

Each seed runs the digits job on 4 ranks in live mode with replacements (`lockstep train digits -n 4
--min-world 2 --max-restarts R --hang-timeout 5 --deterministic ...`) and strikes a seeded schedule of
faults at it, one every few seconds (the gap is drawn from --gap):

| kind | what the tool does |
| --- | --- |
| kill | SIGKILL a member (any rank) |
| kill_rank0 | SIGKILL the member that is rank 0 |
| stop | SIGSTOP a member: the survivors evict it after the hang timeout, the launcher kills it |
| straggler | throttle a member to 10% of a core (a cgroup's CPU quota) until rank 0 evicts it as a straggler |
| double | SIGKILL a member, then another while the survivors re-form (two faults in one recovery) |
| stop_in_recovery | SIGKILL a member, then SIGSTOP another while the survivors re-form (no watchdog runs then) |
| joiner_queued | SIGKILL a member, then its replacement as soon as it queues to join |
| joiner_admitted | SIGKILL a member, then its replacement as soon as the members admitted it |
| joiner_healing | SIGKILL a member, then its replacement while it receives the run's state |
| checkpoint_rank0 | SIGKILL rank 0 while its background checkpoint write is in flight |

With `--shard-degree 2` the job runs in replica groups of 2 ranks, each holding the model in shards
(FSDP2; `--global-batch-size 64` so that a step divides over 4 and 2 ranks): a member lost takes its group
out and a group is replaced whole, so `double` and `stop_in_recovery` strike two ranks of one group (a node
lost), and every kind waits until both groups are whole again.

A seed passes when the job exits 0, wrote summary.json, ends with the fault-free run's parameter and
optimizer bits (deterministic mode: the same bits at any world size), and every member struck is in the
record: in summary.json's `faults` (a member) or in the launcher's lines (a replacement never admitted).
The tool reads the job's c10d store (the launcher prints its address) to see the members and the join
queue; it never writes to it.

A seed still running at --timeout is stopped; its folder then holds `stalled.txt`: the membership keys of
every generation (who checked in, who formed) and, where py-spy is installed, every worker's Python stacks.

    python tools/chaos.py --seeds 50 --report benchmarks/results/2026-11-29-chaos.md
    python tools/chaos.py --seeds 1 --first 7 --json out.json    # one seed, as the test suite runs it
    python tools/chaos.py --seeds 20 --kinds joiner_admitted double --timeout 200   # hunt one race

Exit code 0 when every seed passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KINDS = (
    "kill",
    "kill_rank0",
    "stop",
    "straggler",
    "double",
    "stop_in_recovery",
    "joiner_queued",
    "joiner_admitted",
    "joiner_healing",
    "checkpoint_rank0",
)
LAUNCHED = 4  # ranks launched
MIN_WORLD = 2
LIVE = "lockstep/live/"  # runtime/membership/keys.py's ROOT (read here without importing lockstep)
CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (the straggler's throttle; root only)


DIGITS_ARGS = ("--global-batch-size", "48", "--micro-batch-size", "8", "--epochs", "1000")
# --shard-degree 2: a step's micro-batches divide evenly over every world the groups can shrink to (4, 2)
SHARDED_DIGITS_ARGS = ("--global-batch-size", "64", "--micro-batch-size", "8", "--epochs", "1000")


@dataclass
class Settings:
    steps: int = 2400
    faults: int = 5
    gap: tuple[float, float] = (2.0, 8.0)  # seconds between faults, drawn uniformly
    replacements: int = 20
    timeout_s: float = 420.0  # one run, end to end
    kinds: tuple[str, ...] = KINDS  # the kinds a schedule draws from (--kinds: a few, to hunt one race)
    job: str = "digits"  # the built-in job (benchmarks/goodput.py runs gpt)
    job_args: tuple[str, ...] = DIGITS_ARGS  # the job's own settings, after --deterministic
    checkpoint_every: int = 40
    live: bool = True  # False: --max-restarts restarts the whole job (no --min-world, no --evict-stragglers)
    ranks: int = LAUNCHED
    # the fault-free run's ranks: the launched world (its wall time is the report's baseline), or fewer,
    # where only its bits matter (deterministic mode's are the same at any world size: the test's 1)
    reference_ranks: int = LAUNCHED
    # > 1: replica groups of this many ranks, each holding the model in shards (FSDP2); a member lost takes
    # its group out, and a group is replaced whole (runtime/membership/replica_groups.py)
    shard_degree: int = 1

    def command(self, run_dir: Path) -> list[str]:
        live = ["--min-world", str(MIN_WORLD)] if self.live else []
        evict = ["--evict-stragglers", "3"] if self.live else []
        shard = ["--shard-degree", str(self.shard_degree)] if self.shard_degree > 1 else []
        return [
            sys.executable,
            "-m",
            "lockstep",
            "train",
            self.job,
            "-n",
            str(self.ranks),
            *live,
            "--max-restarts",
            str(self.replacements),
            "--hang-timeout",
            "5",
            *evict,
            *shard,
            "--deterministic",
            *self.job_args,
            "--max-steps",
            str(self.steps),
            "--checkpoint-every",
            str(self.checkpoint_every),
            "--checkpoint-async",
            "true",
            "--progress",
            "lines",
            "--run-dir",
            str(run_dir),
        ]


@dataclass
class Strike:
    """One fault struck: its kind, when (seconds after the launch), the members hit."""

    kind: str
    at_s: float
    victims: list[int] = field(default_factory=list)
    note: str = ""
    hits_s: list[float] = field(default_factory=list)  # when each victim was hit (seconds after the launch)

    def hit(self, member: int, job: Job) -> None:
        self.victims.append(member)
        self.hits_s.append(round(job.elapsed(), 2))


@dataclass
class SeedResult:
    seed: int
    exit_code: int | None
    summary: bool
    same_bits: bool
    recorded: bool
    wall_s: float
    strikes: list[Strike]
    faults: list[dict[str, Any]]
    why: str = ""

    restarts: int = 0  # whole-job restarts the launcher made (a job-ending error, then resumed)
    goodput: float | None = None  # summary.json's: the counted steps' time over the run's
    lost_s_by_cause: dict[str, float] = field(default_factory=dict)
    samples_lost: int | None = None

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and self.summary and self.same_bits and self.recorded and not self.why


class Job:
    """One launched job: its process, its run directory, its store (read only)."""

    def __init__(self, settings: Settings, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.log = open(run_dir.parent / "launcher.log", "w+b")  # noqa: SIM115  closed in finish()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            settings.command(run_dir),
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.started = time.monotonic()
        self.store: Any = None
        self.generation = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def running(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.run_dir.parent / "launcher.log").read_text(errors="replace")

    def connect(self, deadline: float) -> bool:
        """The store's address from the launcher's first line; a read-only client of it."""
        import torch.distributed as dist

        while time.monotonic() < deadline and self.running():
            found = re.search(r"store ([\d.]+):(\d+)", self.text())
            if found:
                self.store = dist.TCPStore(
                    found.group(1), int(found.group(2)), None, False, timeout=timedelta(seconds=10)
                )
                return True
            time.sleep(0.1)
        return False

    def has(self, key: str) -> bool:
        return bool(self.store.check([LIVE + key]))

    def members(self) -> list[int]:
        """The members of the newest generation formed so far."""
        while self.has(f"gen{self.generation + 1}/members"):
            self.generation += 1
        key = f"gen{self.generation}/members"
        return json.loads(bytes(self.store.get(LIVE + key)).decode()) if self.has(key) else []

    def pid(self, member: int) -> int | None:
        try:
            return int((self.run_dir / f"rank{member}" / "pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def alive(self, member: int) -> bool:
        pid = self.pid(member)
        if pid is None or self.has(f"dead/{member}"):
            return False
        try:
            with open(f"/proc/{pid}/stat") as fh:
                # a stopped member (SIGSTOP, not yet evicted) cannot hold the job above --min-world either
                return fh.read().split(")")[-1].split()[0] not in ("Z", "X", "T", "t")
        except OSError:
            return False

    def signal(self, member: int, sig: int) -> bool:
        pid = self.pid(member)
        return pid is not None and _signal(pid, sig)

    def queued(self) -> list[int]:
        """Replacements in the join queue, in order."""
        count = int(self.store.add(LIVE + "join/count", 0))
        out = []
        for n in range(1, count + 1):
            if self.has(f"join/{n}"):
                out.append(int(bytes(self.store.get(LIVE + f"join/{n}")).decode()))
        return out

    def finish(self, timeout: float) -> int | None:
        """The launcher's exit code; None when it ran past `timeout` (then it and its workers are stopped)."""
        try:
            return self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.snapshot(self.run_dir.parent / "stalled.txt")
            self.stop()
            return None
        finally:
            self.log.close()

    def snapshot(self, path: Path) -> None:
        """What a stalled job looked like, for its post-mortem: the membership keys of every generation and,
        where py-spy is installed, each running worker's Python stacks."""
        lines: list[str] = []
        if self.store is not None:
            lines.append(f"changes = {int(self.store.add(LIVE + 'changes', 0))}")
            generation, empty = 0, 0
            while empty < 20:  # generations are numbered densely; a run of empty ones is past the last
                found = {
                    w: [m for m in range(64) if self.has(f"gen{generation}/{w}/{m}")]
                    for w in ("in", "formed")
                }
                key = f"gen{generation}/members"
                members = bytes(self.store.get(LIVE + key)).decode() if self.has(key) else None
                empty = empty + 1 if members is None and not found["in"] else 0
                if empty == 0:
                    lines.append(
                        f"gen{generation}: members={members} in={found['in']} formed={found['formed']}"
                    )
                generation += 1
        for member in range(64):
            if self.store is not None and self.has(f"dead/{member}"):
                lines.append(f"dead/{member} = {bytes(self.store.get(LIVE + f'dead/{member}')).decode()}")
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        for member in range(LAUNCHED + 64):
            pid = self.pid(member)
            if pid is None or not Path(f"/proc/{pid}").exists() or not Path(spy).exists():
                continue
            dump = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
            )
            lines += [f"==== member {member} (pid {pid})", dump.stdout, dump.stderr]
        path.write_text("\n".join(lines) + "\n")

    def stop(self) -> None:
        """Stop the job and leave nothing behind: the launcher stops its workers on SIGTERM (each worker
        runs in a session of its own); whatever still runs after the grace is killed by pid."""
        for member in range(LAUNCHED + 64):
            pid = self.pid(member)
            if pid is not None:
                _signal(pid, signal.SIGCONT)  # a stopped worker ends on SIGTERM only once continued
        _signal(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _signal(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for member in range(LAUNCHED + 64):
            pid = self.pid(member)
            if pid is not None:
                _signal(pid, signal.SIGKILL)


class Striker:
    """Strikes one fault of a kind at the job; waits until the job can lose a member without falling
    below --min-world (a fault that would end the job is not what the schedule tests). With replica groups
    of `size` (a sharded run) a member lost takes its group out, so the second member a kind strikes in
    one recovery (double, stop_in_recovery) is the first one's group-mate: a node lost."""

    def __init__(self, job: Job, rng: random.Random, size: int = 1) -> None:
        self.job, self.rng, self.size = job, rng, size

    def healthy(self, need: int, wait_s: float = 90.0) -> list[int] | None:
        """The members to strike at, once none is dying and at least `need` hold the run's state (launched
        first, or a replacement that is `healed/<member>`): a replacement still joining cannot hold the job
        above --min-world, and is no target; None on time out."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and self.job.running():
            try:
                members = self.job.members()
            except RuntimeError:
                return None
            alive = [m for m in members if self.job.alive(m)]
            ready = [m for m in alive if m < LAUNCHED or self.job.has(f"healed/{m}")]
            if len(ready) >= need and len(alive) == len(members):
                return ready
            time.sleep(0.05)
        return None

    def strike(self, kind: str) -> Strike:
        strike = Strike(kind, round(self.job.elapsed(), 2))
        two = 2 if self.size == 1 else self.size  # the members two faults in one recovery take out
        need = {"double": MIN_WORLD + two, "stop_in_recovery": MIN_WORLD + two}.get(
            kind, MIN_WORLD + self.size
        )
        members = self.healthy(need)
        if members is None:
            strike.note = f"skipped: fewer than {need} healthy members"
            return strike
        strike.at_s = round(self.job.elapsed(), 2)
        getattr(self, kind)(strike, members)
        return strike

    def _kill(self, strike: Strike, member: int) -> None:
        if self.job.signal(member, signal.SIGKILL):
            strike.hit(member, self.job)

    def kill(self, strike: Strike, members: list[int]) -> None:
        self._kill(strike, self.rng.choice(members))

    def kill_rank0(self, strike: Strike, members: list[int]) -> None:
        self._kill(strike, min(self.job.members()))  # rank 0: the lowest member id of the generation

    def stop(self, strike: Strike, members: list[int]) -> None:
        victim = self.rng.choice(members)
        if self.job.signal(victim, signal.SIGSTOP):
            strike.hit(victim, self.job)

    def straggler(self, strike: Strike, members: list[int]) -> None:
        """A member throttled to 10% of a core (a cgroup's CPU quota): its compute crawls while it keeps
        running and publishing (a stopped process would be seen stopped, and its stops inside collectives
        would count as waiting), until rank 0 evicts it as a straggler."""
        victim = self.rng.choice(members[1:])  # rank 0 judges the stragglers
        pid = self.job.pid(victim)
        if pid is None or not CPU_CGROUP.is_dir():
            strike.note = "no pid" if pid is None else f"no cpu cgroup at {CPU_CGROUP}"
            return
        group = throttle_group(f"lockstep-chaos-{os.getpid()}")
        try:
            (group / "cgroup.procs").write_text(str(pid))
            strike.hit(victim, self.job)
            deadline = time.monotonic() + 40.0
            while time.monotonic() < deadline and self.job.running() and not self.job.has(f"dead/{victim}"):
                time.sleep(0.05)
        except OSError:  # it ended meanwhile
            pass
        finally:
            _release(group)
        if strike.victims and not self.job.has(f"dead/{victim}"):
            del strike.hits_s[strike.victims.index(victim)]
            strike.victims.remove(victim)
            strike.note = "not evicted within 40 s"

    def _two(self, members: list[int]) -> tuple[int, int]:
        """Two members to strike in one recovery: any two; in replica groups, two of one group."""
        if self.size == 1:
            first, second = self.rng.sample(members, 2)
            return first, second
        generation = self.job.members()
        first = self.rng.choice([m for m in members if m in generation])
        start = generation.index(first) // self.size * self.size
        mates = [m for m in generation[start : start + self.size] if m != first]
        return first, self.rng.choice(mates)

    def double(self, strike: Strike, members: list[int]) -> None:
        first, second = self._two(members)
        self._kill(strike, first)
        time.sleep(self.rng.uniform(0.0, 0.4))
        self._kill(strike, second)

    def stop_in_recovery(self, strike: Strike, members: list[int]) -> None:
        """A member killed, and another stopped while the survivors re-form (no hang watchdog runs then):
        stopped before it checks in, or between its check-in and the new group's first step."""
        first, second = self._two(members)
        self._kill(strike, first)
        time.sleep(self.rng.uniform(0.0, 0.2))
        if self.job.signal(second, signal.SIGSTOP):
            strike.hit(second, self.job)

    def _joiner(self, strike: Strike, members: list[int], stage: str) -> None:
        """Kill a member, then the replacement the launcher starts for it, at `stage` of its join."""
        started = self._started()
        self._kill(strike, self.rng.choice(members))
        deadline = time.monotonic() + 40.0
        joiner = None
        while time.monotonic() < deadline and self.job.running():
            joiner = joiner if joiner is not None else next(iter(sorted(self._started() - started)), None)
            if joiner is not None and self._reached(joiner, stage):
                if stage == "healing":
                    time.sleep(self.rng.uniform(0.0, 0.3))
                self._kill(strike, joiner)
                return
            time.sleep(0.005)
        strike.note = f"no replacement reached stage {stage!r}"

    def _started(self) -> set[int]:
        """Member ids of every worker the launcher started so far (its rank directories)."""
        return {int(p.name[4:]) for p in self.job.run_dir.glob("rank*") if p.name[4:].isdigit()}

    def _reached(self, joiner: int, stage: str) -> bool:
        if stage == "queued":
            return joiner in self.job.queued()
        return self.job.has(f"admit/{joiner}")

    def joiner_queued(self, strike: Strike, members: list[int]) -> None:
        self._joiner(strike, members, "queued")

    def joiner_admitted(self, strike: Strike, members: list[int]) -> None:
        self._joiner(strike, members, "admitted")

    def joiner_healing(self, strike: Strike, members: list[int]) -> None:
        self._joiner(strike, members, "healing")

    def checkpoint_rank0(self, strike: Strike, members: list[int]) -> None:
        folder = self.job.run_dir / "checkpoints"
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and self.job.running():
            if folder.is_dir() and _being_written(folder):
                self._kill(strike, min(self.job.members()))
                return
            time.sleep(0.002)
        strike.note = "no background checkpoint write seen"


def _being_written(folder: Path) -> bool:
    """A checkpoint write in flight in `folder`: the temp directory of a step newer than every published one
    (checkpoint/layout.py's names: made as the write starts; an older one is a leftover), or the `latest`
    pointer being replaced as a write ends."""
    names = [p.name for p in folder.iterdir()]
    published = [int(n[len("step_") :]) for n in names if n.startswith("step_") and n[5:].isdigit()]
    temps = [int(n.split("_")[1].split("-")[0]) for n in names if n.startswith(".tmp-step_")]
    newest = max(published, default=-1)
    return any(step > newest for step in temps) or any(n.endswith(".partial") for n in names)


def throttle_group(name: str) -> Path:
    """A cgroup that gives what joins it 10% of a core: 1 ms of CPU every 10 ms, so every step is slowed
    (a long period would let a few steps run at full speed and stall one, which the straggler judgement's
    medians rightly ignore)."""
    group = CPU_CGROUP / name
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text("10000")
    (group / "cpu.cfs_quota_us").write_text("1000")
    return group


def _release(group: Path) -> None:
    """Move what still runs in the throttling cgroup back to the root one, and remove the cgroup."""
    for line in (group / "cgroup.procs").read_text().split():
        try:
            (CPU_CGROUP / "cgroup.procs").write_text(line)
        except OSError:
            pass
    for _ in range(50):  # a victim being killed leaves the cgroup a moment after it is signalled
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def schedule(seed: int, settings: Settings) -> list[tuple[float, str]]:
    """The seed's faults: (gap before it in seconds, kind); kinds cycle through a seeded permutation."""
    rng = random.Random(seed)
    kinds = list(settings.kinds)
    rng.shuffle(kinds)
    return [(rng.uniform(*settings.gap), kinds[i % len(kinds)]) for i in range(settings.faults)]


def run_seed(seed: int, settings: Settings, reference: dict[str, Any], workdir: Path) -> SeedResult:
    folder = workdir / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    job = Job(settings, folder / "run")
    rng = random.Random(seed * 7919 + 1)
    strikes: list[Strike] = []
    why = ""
    try:
        if not job.connect(time.monotonic() + 60):
            why = "the launcher printed no store address"
        else:
            _strike_all(job, Striker(job, rng, settings.shard_degree), schedule(seed, settings), strikes)
        code = job.finish(settings.timeout_s - job.elapsed())
    except BaseException:  # Ctrl-C, a bug of the tool's: the job must not outlive it
        job.stop()
        raise
    wall = job.elapsed()
    summary_file = folder / "run" / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    same = bool(summary) and all(
        summary.get(k) == reference[k] for k in ("params_sha256", "optimizer_sha256")
    )
    recorded, missing = _recorded(strikes, summary, job.text())
    if code != 0:
        why = why or f"exit code {code}"
    elif not summary:
        why = "no summary.json"
    elif not same:
        why = "bits differ from the fault-free run"
    elif missing:
        why = f"struck members not in the record: {missing}"
    if len([s for s in strikes if s.victims]) < settings.faults and not why:
        why = f"only {len([s for s in strikes if s.victims])} faults struck"
    return SeedResult(
        seed,
        code,
        bool(summary),
        same,
        recorded and not missing,
        wall,
        strikes,
        summary.get("faults", []),
        why,
        int(summary.get("restarts") or 0),
        summary.get("goodput"),
        summary.get("lost_s_by_cause", {}),
        summary.get("samples_lost"),
    )


def _strike_all(job: Job, striker: Striker, faults: list[tuple[float, str]], strikes: list[Strike]) -> None:
    striker.healthy(LAUNCHED, wait_s=60)  # generation 0 formed
    _wait_for_training(job, deadline=time.monotonic() + 120)
    for gap, kind in faults:
        time.sleep(gap)
        if not job.running():
            return
        try:
            strikes.append(striker.strike(kind))
        except RuntimeError as exc:  # the store went away: the job ended meanwhile
            strikes.append(Strike(kind, round(job.elapsed(), 2), note=f"store gone: {exc}"[:80]))
            return


def _wait_for_training(job: Job, deadline: float) -> None:
    """Strike only once the job trains (rank 0 logged its first steps): faults during start-up are
    tests/cli/test_live.py's start-up tests, and a start-up is judged by the hang watchdog's allowance."""
    log = job.run_dir / "metrics.jsonl"  # created empty at start-up, its first line after log_every steps
    while time.monotonic() < deadline and job.running() and not (log.exists() and log.stat().st_size > 0):
        time.sleep(0.1)


def _recorded(strikes: list[Strike], summary: dict[str, Any], launcher: str) -> tuple[bool, list[int]]:
    lost = {m for record in summary.get("faults", []) for m in record.get("lost", [])}
    missing = []
    for strike in strikes:
        for member in strike.victims:
            if member not in lost and not re.search(rf"rank {member} (killed|evicted|exit|gave)", launcher):
                missing.append(member)
    return not missing, missing


def reference_cache(settings: Settings, workdir: Path) -> Path:
    fewer = f"-n{settings.reference_ranks}" if settings.reference_ranks != LAUNCHED else ""
    sharded = f"-s{settings.shard_degree}" if settings.shard_degree > 1 else ""
    return workdir / f"reference-{settings.steps}{fewer}{sharded}.json"


def reference_run(settings: Settings, workdir: Path) -> dict[str, Any]:
    """The fault-free run's summary (cached in the work directory by the settings). On fewer ranks than the
    launched world it runs without live mode, restarts or eviction: nothing can strike it."""
    cache = reference_cache(settings, workdir)
    if cache.exists():
        return json.loads(cache.read_text())
    folder = workdir / "reference"
    folder.mkdir(parents=True, exist_ok=True)
    if settings.reference_ranks != LAUNCHED:  # unsharded too: deterministic mode's bits are the same
        settings = replace(
            settings, ranks=settings.reference_ranks, live=False, replacements=0, shard_degree=1
        )
    job = Job(settings, folder / "run")
    try:
        code = job.finish(settings.timeout_s)
    except BaseException:  # Ctrl-C, SIGTERM: the job must not outlive the tool
        job.stop()
        raise
    summary_file = folder / "run" / "summary.json"
    if code != 0 or not summary_file.exists():
        raise SystemExit(f"chaos: the fault-free run failed (exit {code}):\n{job.text()[-3000:]}")
    summary = json.loads(summary_file.read_text())
    summary["wall_total_s"] = round(job.elapsed(), 2)
    cache.write_text(json.dumps(summary))
    return summary


def report(results: list[SeedResult], reference: dict[str, Any], settings: Settings) -> str:
    """The markdown table of the seeds and the time lost per fault kind."""
    passed = sum(r.passed for r in results)
    lines = [
        f"# Chaos schedules: {passed} of {len(results)} seeds survived",
        "",
        f"digits, {LAUNCHED} ranks"
        + (
            f" in replica groups of {settings.shard_degree} (--shard-degree)"
            if settings.shard_degree > 1
            else ""
        )
        + f", --min-world {MIN_WORLD}, --max-restarts {settings.replacements}, "
        f"--hang-timeout 5, --evict-stragglers 3, deterministic, {settings.steps} steps, "
        f"{settings.faults} faults a seed, {settings.gap[0]:g}-{settings.gap[1]:g} s apart. Fault-free run: "
        f"{reference.get('wall_total_s', 0):.1f} s end to end on {settings.reference_ranks} ranks. Machine: {os.cpu_count()} cores, "
        f"torch {_torch_version()}, gloo.",
        "",
        "| seed | faults struck (kind: members) | exit | summary | same bits | recorded | restarts | wall s "
        "| goodput | samples lost | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        struck = "; ".join(f"{s.kind}: {s.victims or s.note}" for s in r.strikes)
        lines.append(
            f"| {r.seed} | {struck} | {r.exit_code} | {_yes(r.summary)} | {_yes(r.same_bits)} | "
            f"{_yes(r.recorded)} | {r.restarts} | {r.wall_s:.1f} | {_value(r.goodput)} | "
            f"{_value(r.samples_lost)} | {'pass' if r.passed else 'FAIL: ' + r.why} |"
        )
    causes = sorted({c for r in results for c in r.lost_s_by_cause})
    if causes:
        lines += [
            "",
            "Time lost by cause (summary.json's `lost_s_by_cause`, seconds; the fault-free run's goodput: "
            f"{_value(reference.get('goodput'))}):",
            "",
            "| seed | " + " | ".join(causes) + " |",
            "| --- | " + " | ".join("---" for _ in causes) + " |",
        ]
        for r in results:
            lost = r.lost_s_by_cause
            lines.append(f"| {r.seed} | " + " | ".join(_value(lost.get(c)) for c in causes) + " |")
    lines += [
        "",
        "Time lost per fault kind, from the fault records of the passing seeds: detection (how long the "
        "survivors waited in the failed collective: for a stopped rank, a second or so on the survivors' host "
        "(all of them here), the hang timeout elsewhere) and recovery "
        "(re-forming the group, rebuilding the replica, converging, the state sent to a replacement); the "
        "redone step comes on top. A kind that strikes a replacement too is counted by the member it lost.",
        "",
        "| kind | strikes | members struck | median detection s | median recovery s | max recovery s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, (count, lost, waits, times) in _by_kind(results).items():
        lines.append(
            f"| {kind} | {count} | {lost} | {_median(waits)} | {_median(times)} | "
            f"{f'{max(times):.3f}' if times else '-'} |"
        )
    gaps = [b.at_s - a.at_s for r in results for a, b in zip(r.strikes, r.strikes[1:], strict=False)]
    if gaps:
        lines += [
            "",
            f"Interval between two strikes (start to start, all seeds): median {_median(gaps)} s, "
            f"max {max(gaps):.1f} s (a strike waits until enough members are healthy).",
        ]
    hits = [sorted(t for strike in r.strikes for t in strike.hits_s) for r in results]
    apart = [b - a for seed_hits in hits for a, b in zip(seed_hits, seed_hits[1:], strict=False)]
    if apart:
        within = sum(gap <= 8.0 for gap in apart)
        lines += [
            "",
            f"Interval between two hits (a member signalled or throttled, then the next one, all seeds): "
            f"median {_median(apart)} s, max {max(apart):.1f} s; {within} of {len(apart)} within 8 s.",
        ]
    walls = [r.wall_s for r in results if r.passed]
    if walls and settings.reference_ranks == LAUNCHED:  # a baseline on fewer ranks times another job
        extra = statistics.median(walls) - reference.get("wall_total_s", 0)
        lines += [
            "",
            f"Median wall time of a passing seed: {statistics.median(walls):.1f} s "
            f"({extra:+.1f} s against the fault-free run, for {settings.faults} faults).",
        ]
    return "\n".join(lines) + "\n"


def _value(value: float | int | None) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _by_kind(results: list[SeedResult]) -> dict[str, tuple[int, int, list[float], list[float]]]:
    """Per kind: strikes, members struck, detection and recovery seconds of the passing seeds' records."""
    out: dict[str, tuple[int, int, list[float], list[float]]] = {}
    for r in results:
        by_member: dict[int, tuple[float, float]] = {}
        for record in r.faults:
            detail = record.get("detail", {})
            cost = float(record.get("recover_s", 0)) + float(detail.get("converge_s", 0))
            for member in record.get("lost", []):
                by_member[member] = (float(detail.get("waited_s", 0)), cost)
        for s in r.strikes:
            count, lost, waits, times = out.get(s.kind, (0, 0, [], []))
            seen = [by_member[m] for m in s.victims if m in by_member] if r.passed else []
            out[s.kind] = (
                count + 1,
                lost + len(s.victims),
                waits + [w for w, _ in seen],
                times + [c for _, c in seen],
            )
    return out


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "-"


def _load_results(path: Path) -> list[SeedResult]:
    results = []
    for row in json.loads(path.read_text()):
        row.pop("passed", None)
        row["strikes"] = [Strike(**strike) for strike in row["strikes"]]
        results.append(SeedResult(**row))
    return results


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds to run")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--faults", type=int, default=Settings.faults, help="faults a seed")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS, help="the kinds to strike")
    parser.add_argument("--timeout", type=float, default=Settings.timeout_s, help="seconds a seed may run")
    parser.add_argument(
        "--gap",
        type=float,
        nargs=2,
        default=Settings.gap,
        metavar=("MIN", "MAX"),
        help="seconds between faults",
    )
    parser.add_argument(
        "--reference-ranks",
        type=int,
        default=LAUNCHED,
        help="ranks of the fault-free run (fewer: its bits only, not its wall time, are the baseline)",
    )
    parser.add_argument(
        "--shard-degree",
        type=int,
        default=1,
        help="2: the job runs in replica groups of 2 ranks, each holding the model in shards (a member lost "
        "takes its group out; the kinds that strike two members in one recovery strike one group's two)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="only write --report from an earlier run's --json (and --workdir)",
    )
    args = parser.parse_args(argv)
    # SIGTERM (a test's time out, a shell's kill): leave through the exception path, which stops the job
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(128 + signal.SIGTERM))
    settings = Settings(
        steps=args.steps,
        faults=args.faults,
        gap=tuple(args.gap),
        timeout_s=args.timeout,
        kinds=tuple(args.kinds),
        reference_ranks=args.reference_ranks,
        shard_degree=args.shard_degree,
        job_args=SHARDED_DIGITS_ARGS if args.shard_degree > 1 else DIGITS_ARGS,
    )
    if args.render is not None:
        reference = json.loads(reference_cache(settings, args.workdir).read_text())
        text = report(_load_results(args.render), reference, settings)
        (args.report or Path("/dev/stdout")).write_text(text)
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lockstep-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    reference = reference_run(settings, workdir)
    results = []
    for seed in range(args.first, args.first + args.seeds):
        result = run_seed(seed, settings, reference, workdir)
        results.append(result)
        verdict = "pass" if result.passed else f"FAIL ({result.why})"
        struck = ", ".join(f"{s.kind}{s.victims}" for s in result.strikes)
        print(f"seed {seed}: {verdict} in {result.wall_s:.1f} s; {struck}", flush=True)
        text = report(results, reference, settings)  # after every seed: a run cut short keeps its seeds
        if args.report:
            args.report.write_text(text)
        if args.json:
            args.json.write_text(json.dumps([{**asdict(r), "passed": r.passed} for r in results], indent=1))
    print(text.splitlines()[0])
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
