"""What the launcher and the runtime must agree on, and the launcher's own typed pieces (issue 15).

- the attempt number `lockstep run` writes for each worker (launch/rank_logs.py) is the one the worker's
  Topology reads (runtime/env/topology.py), by the one name in runtime/env/env_contract.py, and it wins over
  torch's per-node restart count;
- a stopping signal is a LaunchError that torch's agent still recognises as its SignalException;
- numeric flags of `lockstep run` fail as ConfigError naming the flag and the value;
- LaunchState keeps the latest attempt's rank directories and every attempt's for the final sweep.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import SignalException

from lockstep.errors import ConfigError, LaunchError
from lockstep.launch.local import LaunchState
from lockstep.launch.rank_logs import RunDirLogs
from lockstep.launch.signals import LaunchInterrupted
from lockstep.launch.spec import parse_run_args
from lockstep.runtime.env import env_contract
from lockstep.runtime.env.topology import resolve_topology


def _agent_envs(restart_count: int) -> dict[int, dict[str, str]]:
    """What torch's agent hands RunDirLogs.reify for one node of two workers, on its restart_count-th start."""
    base = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
    }
    return {local: {**base, "RANK": str(local), "LOCAL_RANK": str(local)} for local in (0, 1)}


def test_the_attempt_the_launcher_writes_is_the_one_the_worker_reads(tmp_path: Path) -> None:
    announced: list[int] = []
    logs = RunDirLogs(str(tmp_path), lambda attempt, ranks, env0: announced.append(attempt))
    first = _agent_envs(restart_count=0)
    logs.reify(first)
    # A node restarted for a peer's failure: torch's count stays 0 here, the job is at attempt 1.
    second = _agent_envs(restart_count=0)
    logs.reify(second)
    assert announced == [0, 1]
    assert [resolve_topology(env).agent_store_attempt for env in first.values()] == [0, 0]
    assert [resolve_topology(env).agent_store_attempt for env in second.values()] == [1, 1]
    assert all(env[env_contract.ATTEMPT_VAR] == "1" for env in second.values())
    assert env_contract.ATTEMPT_VAR == "LOCKSTEP_ATTEMPT"  # the name is part of the public environment
    assert (tmp_path / "restart1" / "rank1").is_dir()


def test_without_the_launchers_attempt_torchs_restart_count_is_the_fallback() -> None:
    env = _agent_envs(restart_count=2)[1]
    assert env_contract.ATTEMPT_VAR not in env
    assert resolve_topology(env).agent_store_attempt == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stopping_signal_is_a_launch_error_that_torchs_agent_recognises(sig: signal.Signals) -> None:
    exc = LaunchInterrupted(sig)
    assert isinstance(exc, LaunchError) and isinstance(exc, SignalException) and isinstance(exc, RuntimeError)
    assert exc.sigval == sig
    assert str(exc) == f"lockstep run got {sig.name}"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--node-rank", "one", "s.py"], "--node-rank expects an integer, got 'one'"),
        (["--max-restarts", "2.5", "s.py"], "--max-restarts expects an integer, got '2.5'"),
        (
            ["--monitor-interval", "fast", "s.py"],
            "--monitor-interval expects a number of seconds, got 'fast'",
        ),
    ],
)
def test_numeric_flags_name_the_flag_and_the_value(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_run_args(argv)
    assert needle in str(info.value)
    assert "(see `lockstep run --help`)" in str(info.value)


def test_numeric_flags_are_converted() -> None:
    spec = parse_run_args(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "h:1",
            "--max-restarts",
            "3",
            "--monitor-interval",
            "0.5",
            "s.py",
        ]
    )
    assert (spec.node_rank, spec.max_restarts, spec.monitor_interval) == (1, 3, 0.5)
    defaults = parse_run_args(["s.py"])
    assert (defaults.node_rank, defaults.max_restarts, defaults.monitor_interval) == (None, 0, 0.1)


def test_launch_state_keeps_the_latest_attempt_and_every_directory() -> None:
    state = LaunchState()
    assert (state.world_size, state.current_dirs(), state.all_dirs) == (None, [], [])
    state.record({0: "run/rank0", 1: "run/rank1"}, {"WORLD_SIZE": "2"})
    state.record({0: "run/restart1/rank0", 1: "run/restart1/rank1"}, {"WORLD_SIZE": "2"})
    assert state.world_size == 2
    assert state.current_dirs() == ["run/restart1/rank0", "run/restart1/rank1"]
    assert state.all_dirs == ["run/rank0", "run/rank1", "run/restart1/rank0", "run/restart1/rank1"]
