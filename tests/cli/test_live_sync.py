"""Live mode (`lockstep run --min-world`) with low-communication training (FitConfig.sync): a member is
SIGKILLed in the middle of a round, and the survivors redo that round from its start (the last outer sync).

tests/cli/live_program.py trains 16 steps (2 epochs of 8 steps of 24 samples, 6 micro-batches of 4) with
`sync` diloco or local_sgd, a round of 4 steps (2 with "h2"). What is checked: the job finishes without a
restart; the survivors' parameters are bitwise equal after the final outer sync (step 16 ends a round);
every sample of every step went through a forward, and the only samples that went through twice are those
of the round that was redone; the metric log holds each logged step once (what the abandoned round logged
was cut back); a replacement joins at a round's end, heals from a peer and ends equal to the others.

Streaming DiLoCo ("streaming_diloco", 2 fragments) goes back to the last fragment's sync instead: the lost
member's inner progress since each fragment's last sync is dropped, counted in the fault's `dropped`
(its samples there, trained once, checked against its seen file); the survivors' outer states (anchors,
outer momentum, the mean in flight) end bitwise equal, as does a replacement's.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.data.sampler import epoch_order
from lockstep.trainer.run.low_comm import engine_policy
from lockstep.trainer.settings.config import FitConfig, plan_of
from tests.helpers import run_cli, run_live_program

PROGRAM = Path(__file__).with_name("live_program.py")
SAMPLES, EPOCHS, GLOBAL_BATCH, STEPS_PER_EPOCH = 192, 2, 24, 8
STEPS = EPOCHS * STEPS_PER_EPOCH


def _run(tmp_path: Path, *launch: str, fault: str, victim: int, at: int, extra: tuple[str, ...]) -> Any:
    out = tmp_path / "out"
    result = run_live_program(out, launch, fault, victim, at, extra, timeout=180)
    assert result.returncode == 0, result.stderr
    return out, result


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "run" / "summary.json").read_text())


def _step_samples(step: int) -> set[int]:
    """The samples of step `step` (1-based): its global batch, the same at any world size."""
    epoch, position = divmod(step - 1, STEPS_PER_EPOCH)
    order = epoch_order(SAMPLES, seed=FitConfig().seed, epoch=epoch, shuffle=True)
    return set(order[position * GLOBAL_BATCH : (position + 1) * GLOBAL_BATCH])


def _nothing_lost_and_only_the_redone_round_twice(out: Path, redone: range) -> None:
    seen = Counter(
        int(i)
        for path in out.glob("seen-*.txt")
        for line in path.read_text().split("\n")
        for i in line.split()
    )
    assert all(seen[i] >= EPOCHS for i in range(SAMPLES))  # every sample of each epoch: nothing lost
    twice = {i for i, n in seen.items() if n > EPOCHS}
    allowed = set().union(*(_step_samples(s) for s in redone))
    assert twice <= allowed, sorted(twice - allowed)  # only the abandoned round's samples went through twice
    assert sum(seen.values()) - EPOCHS * SAMPLES <= len(redone) * GLOBAL_BATCH


def _replicas_equal(out: Path, members: list[int]) -> None:
    """Every finishing member's final parameters, bitwise: the replicas are equal after the last sync."""
    params = [torch.load(out / f"params-{uid}.pt", weights_only=True) for uid in members]
    for other in params[1:]:
        assert all(torch.equal(params[0][name], other[name]) for name in params[0])


def _logged_steps(out: Path) -> list[int]:
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "train_loss" in r]


@pytest.mark.parametrize(
    ("sync", "fault", "victim", "at", "mark"),
    [
        # in the forward of step 5 (its 5th: it owns 1 of 6 micro-batches a step), the 2nd round's first
        # step; the survivors learn of it in the round's outer sync at step 8 and redo steps 5 to 8
        pytest.param("diloco", "forward", 2, 5, 4, marks=pytest.mark.smoke),
        ("local_sgd", "forward", 0, 9, 4),  # rank 0 itself (2 micro-batches a step): another takes the log
        # rank 0 while it gathers the workers' states for the checkpoint at step 8 (the epoch's end), after
        # the round's sync but before the round counted (its 3rd state_dict: marks at steps 0 and 4 first)
        ("diloco", "checkpoint", 0, 3, 4),
    ],
)
def test_a_member_lost_mid_round_costs_neither_the_job_nor_samples(
    tmp_path: Path, sync: str, fault: str, victim: int, at: int, mark: int
) -> None:
    out, result = _run(
        tmp_path, "-n", "4", "--min-world", "2", fault=fault, victim=victim, at=at, extra=(sync,)
    )
    assert f"lockstep run: rank {victim} killed by SIGKILL; 3 of 4 ranks go on" in result.stderr
    assert "finished on 3 of 4 ranks, without a restart" in result.stderr, result.stderr
    summary = _summary(out)
    assert summary["sync"] == sync and summary["steps"] == STEPS and summary["world_size"] == 3
    assert summary["samples_this_run"] == STEPS * GLOBAL_BATCH  # the redone round's samples counted once
    [record] = summary["faults"]
    assert record["lost"] == [victim] and record["step"] == mark, record  # back to the round's start
    survivors = [uid for uid in range(4) if uid != victim]
    _replicas_equal(out, survivors)
    _nothing_lost_and_only_the_redone_round_twice(out, range(mark + 1, mark + 5))
    assert _logged_steps(out) == [4, 8, 12, 16]  # log_every=4: each once, the abandoned round's cut back
    assert sorted(p.name for p in (out / "run" / "checkpoints").glob("step_*")) == [
        "step_000008",
        "step_000016",
    ]


def test_a_replacement_joins_at_a_round_boundary_and_heals_from_a_peer(tmp_path: Path) -> None:
    """Rounds of 2 steps; rank 2 dies in step 5; the survivors redo steps 5 and 6 and wait (in their
    forwards) until the replacement process started; rank 0 admits it at the next round's end."""
    out, result = _run(
        tmp_path, "-n", "4", "--min-world", "2", "--max-restarts", "1",
        fault="forward", victim=2, at=5, extra=("replace", "diloco", "h2"),
    )  # fmt: skip
    assert "replacement rank 4 started" in result.stderr, result.stderr
    assert "finished on 4 of 4 ranks (1 of them replacements: ranks [4]), without a restart" in result.stderr
    summary = _summary(out)
    assert summary["world_size"] == 4 and summary["steps"] == STEPS
    lost, joined = summary["faults"]
    assert (lost["kind"], lost["lost"], lost["step"]) == ("lost", [2], 4), lost
    assert (joined["kind"], joined["joined"], joined["world_size"]) == ("joined", [4], 4), joined
    assert joined["step"] % 2 == 0 and 6 <= joined["step"] < STEPS, joined  # at a round's end
    # It trained whole rounds only, one micro-batch a step (rank 3 of 4), from its joining step on.
    assert len((out / "seen-4.txt").read_text().split("\n")) - 1 == STEPS - joined["step"]
    _replicas_equal(out, [0, 1, 3, 4])  # healed: its outer state (anchor, momentum) is the members'
    _nothing_lost_and_only_the_redone_round_twice(out, range(5, 7))


def test_a_member_lost_in_a_round_resumed_mid_way_fails_the_job_with_the_reason(tmp_path: Path) -> None:
    """A checkpoint at step 6 (in the second round of 4): the replicas differ, and a member lost before the
    round's end takes with it inner steps that exist nowhere else. The job fails, the checkpoint intact."""
    out, _ = _run(
        tmp_path, "-n", "4", "--min-world", "2", fault="none", victim=0, at=0, extra=("diloco", "stop6")
    )
    assert _summary(out)["steps"] == 6
    result = run_cli(
        "run", "-n", "4", "--min-world", "2", "--run-dir", str(out / "logs2"), str(PROGRAM), str(out),
        "forward", "2", "1", "diloco", cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert result.returncode != 0
    assert "lockstep run: rank 2 killed by SIGKILL; 3 of 4 ranks go on" in result.stderr, result.stderr
    assert "a member was lost in the round this run resumed in the middle of (step 6)" in result.stderr
    assert "resume from the last checkpoint (at that world size)" in result.stderr
    assert [p.name for p in (out / "run" / "checkpoints").glob("step_*")] == ["step_000006"]


def _outer_equal(out: Path, members: list[int]) -> None:
    """streaming_diloco: the parameters never are equal (a fragment's outer step is merged into each rank's
    local values); the outer state is: every finishing member's anchors, outer momentum and last mean."""
    digests = {json.loads((out / f"summary-{uid}.json").read_text())["outer_sha256"] for uid in members}
    assert len(digests) == 1, digests


def _victim_steps(out: Path, victim: int, steps: list[int]) -> set[int]:
    """The samples the victim trained in `steps` (1-based; one micro-batch a step, one line each)."""
    lines = (out / f"seen-{victim}.txt").read_text().splitlines()
    samples: set[int] = set()
    for step in range(steps[0], steps[1] + 1):
        mine = {int(i) for i in lines[step - 1].split()}
        assert mine <= _step_samples(step), step
        samples |= mine
    return samples


@pytest.mark.parametrize(
    ("fault", "at", "mark", "first", "wire"),
    [
        # F=2 fragments in rounds of 4: fragment 0 synced after steps 2, 6, 10, 14, fragment 1 after 4, 8, ...
        # Rank 2 dies in the forward of step 7, after it launched fragment 0's mean at step 6: back to the
        # mark of step 6, whose mean is taken again over the survivors; rank 2's progress since each
        # fragment's last sync applied before (fragment 0: step 2) is dropped: steps 3 to 6.
        pytest.param("forward", 7, 6, 3, "fp32", marks=pytest.mark.smoke),
        # The same with the outer gradients in int4: the mean in flight is sent again, quantized, over the
        # survivors (live mode does not depend on the wire format)
        ("forward", 7, 6, 3, "int4"),
        # Rank 2 dies in step 6's optimizer step, before launching its fragment 0 mean: the survivors' collective
        # of step 6 is in flight when they learn of it (in the step's commit). Back to the mark of step 4
        # (fragment 1's mean of step 4 sent again); dropped: steps 1 to 4 (fragment 1 never synced before).
        ("optimizer", 6, 4, 1, "fp32"),
        # A fragment's mean in flight 3 steps (--fragment-delay 3): at the mark of step 6 both fragment 1's
        # mean of step 4 (applied at 7) and fragment 0's of step 6 are in flight; both are taken again over
        # the survivors, so rank 2's progress since fragment 1's last applied sync (none) is dropped: steps
        # 1 to 6.
        ("forward", 7, 6, 1, "tau3"),
    ],
)
def test_streaming_diloco_goes_back_to_the_last_fragment_sync_and_counts_what_it_drops(
    tmp_path: Path, fault: str, at: int, mark: int, first: int, wire: str
) -> None:
    extra = ("streaming_diloco", wire)
    out, result = _run(tmp_path, "-n", "4", "--min-world", "2", fault=fault, victim=2, at=at, extra=extra)
    assert "lockstep run: rank 2 killed by SIGKILL; 3 of 4 ranks go on" in result.stderr
    assert "finished on 3 of 4 ranks, without a restart" in result.stderr, result.stderr
    summary = _summary(out)
    assert summary["sync"] == "streaming_diloco" and summary["steps"] == STEPS and summary["world_size"] == 3
    assert summary["samples_this_run"] == STEPS * GLOBAL_BATCH
    if wire == "int4":  # under a quarter of what the 354 parameters' rounds send in fp32 (4 rounds of 16)
        assert summary["comm_bytes"] < 4 * 354 * (STEPS // 4) / 4, summary["comm_bytes"]
    [record] = summary["faults"]
    assert record["lost"] == [2] and record["step"] == mark, record  # back to the last fragment's sync
    dropped = 4 * (mark - first + 1)  # rank 2 of 4: one micro-batch of 4 of the 6 in each step
    assert record["dropped"] == {"members": [2], "steps": [first, mark], "samples": dropped}, record
    assert summary["samples_dropped"] == dropped
    assert len(_victim_steps(out, 2, [first, mark])) == dropped  # trained once, by rank 2 only
    _outer_equal(out, [0, 1, 3])
    # Every sample trained; only those of the steps redone after the mark (at most 2: the loss is found by
    # the next fragment's sync at the latest) went through twice.
    _nothing_lost_and_only_the_redone_round_twice(out, range(mark + 1, mark + 3))
    assert _logged_steps(out) == [4, 8, 12, 16]
    assert sorted(p.name for p in (out / "run" / "checkpoints").glob("step_*")) == [
        "step_000008",
        "step_000016",
    ]


def test_streaming_diloco_admits_a_replacement_at_a_rounds_end_with_the_members_outer_state(
    tmp_path: Path,
) -> None:
    """Rank 2 dies in step 5; the survivors go back to step 4's mark and wait (in their forwards) until the
    replacement process started; rank 0 admits it at a round's end, where fragment 1's mean is waited for
    first, so that the replacement takes the same outer state as the members."""
    out, result = _run(
        tmp_path, "-n", "4", "--min-world", "2", "--max-restarts", "1",
        fault="forward", victim=2, at=5, extra=("replace", "streaming_diloco"),
    )  # fmt: skip
    assert "finished on 4 of 4 ranks (1 of them replacements: ranks [4]), without a restart" in result.stderr
    summary = _summary(out)
    assert summary["world_size"] == 4 and summary["steps"] == STEPS
    lost, joined = summary["faults"]
    assert (lost["kind"], lost["lost"], lost["step"]) == ("lost", [2], 4), lost
    assert lost["dropped"] == {"members": [2], "steps": [1, 4], "samples": 16}, lost
    assert (joined["kind"], joined["joined"], joined["world_size"]) == ("joined", [4], 4), joined
    assert joined["step"] % 4 == 0 and 8 <= joined["step"] < STEPS, joined  # at a round's end
    assert len((out / "seen-4.txt").read_text().splitlines()) == STEPS - joined["step"]
    _outer_equal(out, [0, 1, 3, 4])  # healed: rank 0's anchors, outer momentum and the mean in flight
    _nothing_lost_and_only_the_redone_round_twice(out, range(5, 7))


def test_every_sync_mode_runs_in_live_mode() -> None:
    for sync in ("local_sgd", "diloco", "streaming_diloco"):
        config = FitConfig(sync=sync, fragments=2 if sync == "streaming_diloco" else 1)
        plan_of(config, 2, live=True)  # fit's door lets every sync mode run in live mode
        assert engine_policy(config).sync == sync
