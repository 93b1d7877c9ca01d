"""Live mode across sharded replica groups end to end (issue 46): `lockstep train gpt -n 4 --shard-degree 2
--min-world 2 --deterministic`, 2 replica groups of FSDP 2, a worker SIGKILLed or SIGSTOPped from outside
once the step-40 checkpoint is written, or both workers of one group SIGKILLed (a node lost).

The lost worker's group leaves whole (its other rank is left out with it), the other group goes on in the
processes it started in (their pids, their timeline parts reaching the last step), without a restart, and
the run ends with a fault-free run's bits (deterministic mode: the same bits at any world size, so the
reference runs on one rank). With `--max-restarts 1` a replacement group of two new workers joins, receives
its shards from the live group shard for shard, and the run ends at world 4 with the same bits; the group
costs one of the budget even when both its workers were killed: after rank 0's group is lost the survivors
are renumbered, and the world grows back to its launch size (the case where
a rebuilt model once found an older generation's mesh).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, child_env, lockstep_cli

GPT = ("--dim", "48", "--depth", "2", "--context", "32", "--progress", "none", "--eval-every", "0")
GPT += ("--lr-schedule", "constant", "--warmup-steps", "0", "--checkpoint-every", "40")
DETERMINISTIC = ("--deterministic", "--global-batch-size", "16", "--micro-batch-size", "4")  # K = 4
STEPS = 120  # struck at step 40
# A replacement group's run is longer: its new workers, started at the strike and each importing torch on a
# loaded machine, must join before the end (120 steps once left them not needed: a run that ended first).
REPLACED_STEPS = 240  # they joined at step 114 here, struck at 40


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[str, Any]]:
    """The fault-free run of so many steps on one rank (deterministic: the same bits at any world size)."""
    runs: dict[int, dict[str, Any]] = {}

    def of(steps: int) -> dict[str, Any]:
        if steps not in runs:
            run_dir = tmp_path_factory.mktemp(f"reference{steps}")
            argv = ("train", "gpt", "-n", "1", "--run-dir", str(run_dir), "--max-steps", str(steps))
            proc = lockstep_cli(*argv, *GPT, *DETERMINISTIC, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[steps] = json.loads((run_dir / "summary.json").read_text())
        return runs[steps]

    return of


def _strike(
    run_dir: Path, steps: int, victims: tuple[int, ...], sig: int, *launch: str, mid_write: bool = False
) -> tuple[int, str, dict[int, int]]:
    """The job of `steps` steps, with `sig` sent to launch ranks `victims` once the step-40 checkpoint
    exists (`mid_write`: and the next checkpoint's temp directory, a background write in flight); its exit
    code, its output, and the launched workers' pids at the strike."""
    argv = ["train", "gpt", "-n", "4", "--shard-degree", "2", "--min-world", "2", "--run-dir", str(run_dir)]
    argv += ["--max-steps", str(steps), *GPT, *DETERMINISTIC, *launch]
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep", *argv],
            env=child_env(),
            stdout=fh,
            stderr=fh,
            text=True,
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 180
            while not (run_dir / "checkpoints" / "step_000040").is_dir() and time.monotonic() < deadline:
                time.sleep(0.01)
            while mid_write and not _writing(run_dir, after=40) and time.monotonic() < deadline:
                time.sleep(0.002)
            pids = {rank: int((run_dir / f"rank{rank}" / "pid").read_text()) for rank in range(4)}
            for victim in victims:
                os.kill(pids[victim], sig)
            proc.wait(timeout=300)
        finally:
            proc.kill()
    return proc.returncode, log.read_text(), pids


def _writing(run_dir: Path, after: int) -> bool:
    """The ranks' threads are writing the shards of a checkpoint of a step after `after`: files in its temp
    directory's sharded/ (layout.py, sharded.py)."""
    temps = (run_dir / "checkpoints").glob(".tmp-step_*")
    temps = (p for p in temps if int(p.name.split("_")[1].split("-")[0]) > after)
    return any(any((temp / "sharded").glob("*")) for temp in temps)


def _went_on_in_their_processes(
    run_dir: Path, survivors: list[int], pids: dict[int, int], steps: int
) -> None:
    """The surviving group's workers ran from the first step to the last in the processes they started in."""
    for member in survivors:
        part = json.loads((run_dir / "trace" / f"attempt0-member{member}.json").read_text())
        assert part["pid_hint"] == pids[member] and part["last_step"] == steps, (member, part["pid_hint"])


def _fault_free_bits(summary: dict[str, Any], reference: dict[str, Any], steps: int) -> None:
    assert summary["steps"] == reference["steps"] == steps and summary["restarts"] == 0
    assert summary["params_sha256"] == reference["params_sha256"]
    assert summary["optimizer_sha256"] == reference["optimizer_sha256"]
    assert summary["samples_lost"] == 0


def test_rank_0s_group_killed_the_other_group_finishes_alone_with_the_fault_free_bits(
    tmp_path: Path, reference: Callable[[int], dict[str, Any]]
) -> None:
    run_dir = tmp_path / "run"
    code, out, pids = _strike(run_dir, STEPS, (0,), signal.SIGKILL)
    assert code == 0, out[-4000:]
    assert "rank 1 left out of generation 1: its replica group lost rank 0; 2 of 4 ranks go on" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    _fault_free_bits(summary, reference(STEPS), STEPS)
    assert summary["world_size"] == 2
    assert [(f["lost"], f["world_size"]) for f in summary["faults"]] == [([0, 1], 2)]
    assert summary["faults"][0]["how"]["0"].startswith("killed by SIGKILL")
    _went_on_in_their_processes(run_dir, [2, 3], pids, STEPS)


def test_a_rank_killed_while_the_groups_write_a_checkpoint_in_the_background_is_survived(
    tmp_path: Path, reference: Callable[[int], dict[str, Any]]
) -> None:
    """--checkpoint-async: every rank writes its shards on a thread, over a gloo group of the checkpoint
    manager's own. Rank 2 killed while they do: the write is abandoned with the old group (the survivors'
    threads were in its collectives), the checkpoint is dropped with a warning or kept if it reached the disk
    whole, and the next one is written over the new group; no job-ending error, the fault-free bits."""
    run_dir = tmp_path / "run"
    code, out, pids = _strike(
        run_dir, STEPS, (2,), signal.SIGKILL, "--checkpoint-async", "true", mid_write=True
    )
    assert code == 0, out[-4000:]
    assert "rank 3 left out of generation 1: its replica group lost rank 2" in out, out[-4000:]
    assert "CheckpointError" not in out and "of the whole job" not in out, out[-4000:]
    # Struck while the shards were being written: dropped, or (struck as the write ended) published whole
    # by the old group's rank 0 before the change
    dropped = "checkpoint step_000080 was being written over a group that changed (the write was abandoned)"
    kept = "[rank 0/4] INFO lockstep.checkpoint: checkpoint saved: "
    assert dropped in out or f"{kept}{run_dir}/checkpoints/step_000080\n" in out, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    _fault_free_bits(summary, reference(STEPS), STEPS)
    assert [f["lost"] for f in summary["faults"]] == [[2, 3]], summary["faults"]
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "meta.json").exists()  # written after the change
    _went_on_in_their_processes(run_dir, [0, 1], pids, STEPS)


@pytest.mark.parametrize(
    "victims, sig, survivors",
    [((0, 1), signal.SIGKILL, [2, 3]), ((3,), signal.SIGSTOP, [0, 1])],
    ids=[
        "rank 0's group killed, both its ranks (a node lost): one of the budget, the survivors renumbered, "
        "the world grown back",
        "rank 3 stopped",
    ],
)
def test_a_replacement_group_receives_its_shards_and_the_run_ends_at_world_4_with_the_fault_free_bits(
    tmp_path: Path,
    reference: Callable[[int], dict[str, Any]],
    victims: tuple[int, ...],
    sig: int,
    survivors: list[int],
) -> None:
    """--max-restarts 1: the lost group is replaced whole, for one of the budget, whether its other rank
    was left out with the lost one or killed with it (the launcher reads the groups from the store)."""
    run_dir = tmp_path / "run"
    code, out, pids = _strike(
        run_dir, REPLACED_STEPS, victims, sig, "--max-restarts", "1", "--hang-timeout", "5"
    )
    assert code == 0, out[-4000:]
    assert out.count("replacement rank") == 2, out  # one of the budget: the group replaced whole
    assert "(2 of them replacements: ranks [4, 5])" in out or "ranks [5, 4])" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    _fault_free_bits(summary, reference(REPLACED_STEPS), REPLACED_STEPS)
    assert summary["world_size"] == 4
    lost = sorted(set(range(4)) - set(survivors))
    changes = [(f["lost"], sorted(f["joined"]), f["world_size"]) for f in summary["faults"]]
    assert changes == [(lost, [], 2), ([], [4, 5], 4)], changes
    _went_on_in_their_processes(run_dir, survivors, pids, REPLACED_STEPS)
