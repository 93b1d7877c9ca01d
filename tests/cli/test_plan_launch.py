"""`lockstep train` checks the run's plan before any worker starts: every refused pair of the table ends the
command with exit status 2 and one line naming both settings, and writes nothing; a fallback runs and says
why once; deterministic mode without a global batch is refused the same way (a global batch made from the
launch's ranks would change at a resume on another number of ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.plan import PYTHON_ONLY, RULES, SETTINGS, Verdict
from tests.helpers import lockstep_cli

_VALUES = {
    "bucket_cap_mb": "4",
    "grad_accum_steps": "2",
    "clip_grad_norm": "1.0",
    "max_restarts": "1",
    "sync_warmup": "2",
    "fragments": "2",
    "fragment_delay": "2",
    "shard_degree": "2",
}


def _flags(key: str) -> list[str]:
    """The command-line flags of a table key: --min-world 1 for live mode, a value where the table has none."""
    name, _, value = key.partition("=")
    if key == "live":
        return ["--min-world", "1"]
    if key == "deterministic":
        return ["--deterministic", "--global-batch-size", "64"]
    flag = "--" + name.replace("_", "-")
    return [flag, value or _VALUES.get(name, "true")]


def _flag_name(key: str) -> str:
    return next(s.flag for s in SETTINGS if s.key == key).partition(" ")[0]


# The pairs of `lockstep train`'s settings (the engine's own knobs and LiveLoop have no flag:
# tests/unit/test_plan.py, tests/unit/test_plan_doors.py)
REFUSED = [
    (r.first, r.second)
    for r in RULES
    if r.verdict is Verdict.REFUSED and not {r.first, r.second} & set(PYTHON_ONLY)
]


@pytest.mark.smoke
@pytest.mark.parametrize("pair", REFUSED, ids=["+".join(p) for p in REFUSED])
def test_a_refused_pair_is_one_line_and_exit_2_before_any_worker(
    pair: tuple[str, str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    flags = [flag for key in pair for flag in _flags(key)]
    done = lockstep_cli("train", "toy", "-n", "2", "--run-dir", str(run_dir), *flags, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lockstep train: error: "), done.stderr
    for key in pair:
        assert _flag_name(key) in lines[0], f"{lines[0]!r} does not name {_flag_name(key)}"
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not run_dir.exists(), "a refused run wrote its run directory (config.json or a rank's logs)"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--deterministic"], "--deterministic without --global-batch-size: "),
        (
            ["--min-world", "1", "--global-batch-size", "4", "--micro-batch-size", "4"],
            "--min-world without --deterministic on 2 ranks, 1 micro-batches of 4 in a step of 4 samples: ",
        ),
    ],
    ids=["deterministic without a global batch", "float live mode with fewer micro-batches than ranks"],
)
def test_a_value_the_plan_refuses_is_one_line_and_exit_2_before_any_worker(
    flags: list[str], words: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    done = lockstep_cli("train", "toy", "-n", "2", "--run-dir", str(run_dir), *flags, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines == [lines[0]] and lines[0].startswith(f"lockstep train: error: {words}"), done.stderr
    assert not run_dir.exists(), "a refused run wrote its run directory"


def test_deterministic_with_a_global_batch_notes_what_grad_accum_steps_does_not_do(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = lockstep_cli(
        "train", "toy", "-n", "2", "--run-dir", str(run_dir), "--max-steps", "4", "--deterministic",
        "--global-batch-size", "32", "--grad-accum-steps", "2", "--batch-size", "8",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    notes = [line for line in done.stderr.splitlines() if line.startswith("lockstep train: note: ")]
    assert notes == [
        "lockstep train: note: --grad-accum-steps 2 with --deterministic: deterministic mode cuts each step's "
        "global batch (global_batch_size) into micro-batches of micro_batch_size; grad_accum_steps does not apply"
    ], notes
    assert json.loads((run_dir / "config.json").read_text())["global_batch_size"] == 32
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4


def test_a_fallback_runs_and_says_why_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = lockstep_cli(
        "train", "toy", "-n", "2", "--run-dir", str(run_dir), "--max-steps", "4", "--overlap-optimizer", "true",
        "--clip-grad-norm", "1.0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    notes = [line for line in done.stderr.splitlines() if line.startswith("lockstep train: note: ")]
    assert notes == [
        "lockstep train: note: --overlap-optimizer true with --clip-grad-norm 1.0: gradient clipping by global norm "
        "needs every gradient before any parameter steps"
    ]
