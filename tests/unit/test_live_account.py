"""The launcher's account of live mode (launch/live_account.py): how each ended worker counts, and the exit
code and last line it gives; and the bootstrap's one rank prefix however many groups were formed."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch.distributed as dist

from lockstep.launch import worker
from lockstep.launch.live_account import Ending, Replacements, ending, outcome
from lockstep.launch.live_workers import LiveWorker
from lockstep.runtime.env.env_contract import MEMBER_ID_VAR
from lockstep.runtime.membership import keys


class _Ended:
    """A finished process as LiveWorker reads it: its exit code and pid."""

    def __init__(self, returncode: int) -> None:
        self.returncode, self.pid = returncode, 4242

    def poll(self) -> int:
        return self.returncode


def _worker(tmp: Path, member: int, code: int, *, raised: str = "", **flags: Any) -> LiveWorker:
    rank_dir = tmp / f"rank{member}"
    rank_dir.mkdir()
    if raised:
        record = {"message": {"message": raised, "extraInfo": {"py_callstack": f"Traceback\n{raised}\n"}}}
        (rank_dir / "error.json").write_text(json.dumps(record))
    w = LiveWorker(member, member % 4, member % 4, str(rank_dir), cast(Any, _Ended(code)), cast(Any, ()))
    for name, value in flags.items():
        setattr(w, name, value)
    return w


@pytest.mark.parametrize(
    ("code", "raised", "flags", "expected"),
    [
        (0, "", {}, Ending.FINISHED),
        (0, "", {"joiner": True, "admitted": True}, Ending.FINISHED),
        (0, "", {"joiner": True}, Ending.NOT_NEEDED),  # "not needed: the job ended before it joined"
        (-9, "", {}, Ending.FAULT),  # killed by a signal
        (75, "", {}, Ending.FAULT),  # left out of a generation (EVICTED_EXIT_CODE)
        (1, "", {}, Ending.FAULT),  # exited without an exception record
        (1, "ValueError: boom", {"evicted": "evicted by the survivors"}, Ending.FAULT),
        (1, "InternalError: steps differ", {}, Ending.ERROR),
        (3, "SystemExit: 3 (the script called sys.exit(3))", {}, Ending.ERROR),
        (124, "", {}, Ending.ERROR),  # its hang watchdog reported a hang live mode cannot evict
        (-15, "", {"stopped": True}, Ending.STOPPED),  # the launcher stopped it
        (1, "ValueError: boom", {"stopped": True}, Ending.STOPPED),
    ],
)
def test_how_an_ended_worker_counts(
    tmp_path: Path, code: int, raised: str, flags: dict[str, Any], expected: Ending
) -> None:
    assert ending(_worker(tmp_path, 1, code, raised=raised, **flags)) is expected


def test_survivors_that_raised_fail_the_job_and_unneeded_replacements_do_not_finish_it(
    tmp_path: Path,
) -> None:
    """Issue 49's account: every survivor raised, the replacements started for them were never admitted
    and exited 0. Before, "finished on 3 of 4 ranks (3 of them replacements)" and exit 0."""
    workers = [_worker(tmp_path, 1, -9)]  # the fault the run survived first
    workers += [
        _worker(tmp_path, m, 1, raised="InternalError: the ranks stand at different steps") for m in (0, 2, 3)
    ]
    workers += [_worker(tmp_path, m, 0, joiner=True) for m in (4, 5, 6)]
    code, report = outcome(workers, world=4, restarts=0)
    assert code == 1
    assert "finished" not in report
    assert report.count("lockstep run: FAILED") == 1 and "InternalError" in report


def test_a_finished_run_counts_only_the_ranks_that_trained_to_the_end(tmp_path: Path) -> None:
    workers = [
        _worker(tmp_path, 0, 0),
        _worker(tmp_path, 1, -9),
        _worker(tmp_path, 2, 0),
        _worker(tmp_path, 3, 0),
    ]
    workers += [_worker(tmp_path, 4, 0, joiner=True, admitted=True), _worker(tmp_path, 5, 0, joiner=True)]
    code, report = outcome(workers, world=4, restarts=0)
    assert code == 0
    assert report == (
        "lockstep run: finished on 4 of 4 ranks (1 of them replacements: ranks [4]), without a restart; "
        "lost rank 1 (killed by SIGKILL)"
    )
    code, report = outcome(workers[:1], world=1, restarts=1)
    assert (code, report) == (0, "lockstep run: finished on 1 of 1 ranks, after 1 restart of the whole job")


def test_a_run_where_nobody_finished_fails(tmp_path: Path) -> None:
    workers = [_worker(tmp_path, 0, -9), _worker(tmp_path, 1, 0, joiner=True)]
    code, report = outcome(workers, world=1, restarts=0)
    assert code == 128 + 9 and "FAILED: rank 0/1" in report and "finished" not in report


def _prefixing(hook: Any, prefix: str) -> Any:
    """torch's wrapper (torch/distributed/distributed_c10d.py) as init_process_group installs it."""
    old_hook, excepthook_prefix = hook, prefix

    def _distributed_excepthook(*args: Any) -> None:
        old_stderr = sys.stderr
        sys.stderr = buf = io.StringIO()
        try:
            old_hook(*args)
        finally:
            sys.stderr = old_stderr
        sys.stderr.write(
            "\n".join(f"{excepthook_prefix}: {s}" if s else "" for s in buf.getvalue().split("\n"))
        )

    return _distributed_excepthook


def test_the_bootstrap_prints_one_rank_prefix_however_many_groups_were_formed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hook = sys.__excepthook__
    for rank in (3, 2, 1):  # three generations: launch rank 3 became rank 2, then rank 1
        hook = _prefixing(hook, f"[rank{rank}]")
    monkeypatch.setattr(sys, "excepthook", hook)
    for member, expected in ((None, "[rank3]: "), ("3", "[rank3]: ")):
        if member is None:
            monkeypatch.delenv(MEMBER_ID_VAR, raising=False)
        else:
            monkeypatch.setenv(MEMBER_ID_VAR, member)
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        try:
            raise ValueError("boom")
        except ValueError as exc:
            worker._print_exception(exc, exc.__traceback__)
        lines = [line for line in err.getvalue().splitlines() if line]
        assert lines[0] == f"{expected}Traceback (most recent call last):", lines
        assert lines[-1] == f"{expected}ValueError: boom"
        assert all(line.startswith(expected) and "]: [rank" not in line for line in lines)
    assert worker.MEMBER_ID_VAR == MEMBER_ID_VAR  # the bootstrap's copy of the name (it imports no torch)


def test_a_lost_replica_group_costs_one_replacement_of_the_budget_in_whichever_order_its_members_end() -> (
    None
):
    """--max-restarts 1, a sharded run: the stopped member 1 and its group's member 0 (left out with it) are
    both replaced, whichever ends first; the next group lost gets none; a member lost on its own counts one.
    Here the store holds no groups yet (the members had not said they hold to them): the dead marks tell."""
    mate = "left out of generation 1: its replica group lost rank 1"
    for order in (
        [(0, mate), (1, "evicted by the survivors (stopped)")],
        [(1, "killed by SIGKILL"), (0, mate)],
    ):
        budget = Replacements(1, dist.HashStore())
        assert [budget.replace(member, mark) for member, mark in order] == [True, True]
        assert budget.left == 0
        later = "left out of generation 2: its replica group lost rank 3"
        assert not budget.replace(3, "killed by SIGKILL") and not budget.replace(2, later)
    alone = Replacements(2, dist.HashStore())
    assert alone.replace(0, "killed by SIGKILL") and alone.replace(1, "") and not alone.replace(2, "")


def test_a_replica_group_whose_members_are_all_killed_costs_one_replacement_as_the_store_groups_them() -> (
    None
):
    """Both members of a group killed directly (a node lost, in HSDP): neither dead mark names the other,
    but the store's groups do (`group_size`, each generation's members), so the group costs one of
    --max-restarts and both are replaced; a replacement group admitted later is a group of its own."""
    store = dist.HashStore()
    store.set(keys.GROUP_SIZE, "2")
    store.set(keys.members(0), json.dumps([0, 1, 2, 3]))
    budget = Replacements(2, store)
    assert budget.replace(0, "killed by SIGKILL") and budget.replace(1, "killed by SIGKILL")
    assert budget.left == 1
    store.set(keys.members(1), json.dumps([2, 3]))  # the survivors, renumbered
    store.set(keys.members(2), json.dumps([2, 3, 4, 5]))  # the replacement group admitted
    assert budget.replace(5, "killed by SIGKILL") and budget.left == 0
    assert budget.replace(4, "left out of generation 3: its replica group lost rank 5")
    assert not budget.replace(3, "killed by SIGKILL") and not budget.replace(2, "killed by SIGKILL")
    assert not budget.replace(6, "killed by SIGKILL")  # a replacement never admitted: a group of one
