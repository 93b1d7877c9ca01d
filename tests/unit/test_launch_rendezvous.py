"""The attempt number every node agrees on per rendezvous round (launch/rendezvous.py) and its way to the
workers (launch/logs.py): real c10d stores, one thread per "node"; the multi-node restart itself is
tests/cli/test_multinode.py::test_node_failure_restarts_both_nodes_and_resumes."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lockstep.launch.rank_logs import RunDirLogs
from lockstep.launch.rendezvous import AgreedAttempt, agree_attempt
from lockstep.runtime.env.env_contract import ATTEMPT_VAR


def round_store(job_store: dist.Store, run_id: str, round_: int) -> dist.Store:
    """What torch's c10d rendezvous hands every node of a round: its own prefix over the job's store."""
    return dist.PrefixStore(f"torch.rendezvous.{run_id}.{round_}", job_store)


def agree_on_nodes(server: dist.TCPStore, round_: int, nodes: int, first: int) -> list[int]:
    """Every node of the round agrees at once, each with its own connection to the job's store (node `first`
    starts first: the others may ask before rank 0 has answered)."""
    found: list[int | None] = [None] * nodes
    order = [first, *[n for n in range(nodes) if n != first]]

    def node(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=20))
        found[rank] = agree_attempt(round_store(client, "job", round_), rank)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert all(value is not None for value in found), found
    return [value for value in found if value is not None]


def test_every_node_of_a_round_gets_the_same_number_and_rounds_count_up() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=20), wait_for_workers=False)
    # Round numbers as torch's rendezvous leaves them (a round can be skipped); attempts count 0, 1, 2.
    seen = [agree_on_nodes(server, round_, 3, first) for round_, first in ((1, 0), (2, 2), (4, 1))]
    assert seen == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]


def test_a_node_that_joins_later_gets_the_round_number_not_its_own_count() -> None:
    """A node whose first round is the job's third (elastic --nnodes MIN:MAX) still agrees with the others."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=20), wait_for_workers=False)
    assert agree_on_nodes(server, 1, 1, 0) == [0]
    assert agree_on_nodes(server, 2, 1, 0) == [1]
    assert agree_on_nodes(server, 3, 2, 1) == [2, 2]


def reify(logs: RunDirLogs, restart_count: int) -> dict[int, dict[str, str]]:
    envs = {
        0: {"RANK": "2", "TORCHELASTIC_RESTART_COUNT": str(restart_count)},
        1: {"RANK": "3", "TORCHELASTIC_RESTART_COUNT": str(restart_count)},
    }
    logs.reify(envs)
    return envs


def test_workers_get_the_agreed_attempt_and_its_directory(tmp_path: Path) -> None:
    announced: list[tuple[int, dict[int, str]]] = []
    agreed = AgreedAttempt()
    logs = RunDirLogs(
        str(tmp_path), lambda attempt, ranks, env0: announced.append((attempt, dict(ranks))), agreed
    )
    agreed.value = 0
    assert {env[ATTEMPT_VAR] for env in reify(logs, 0).values()} == {"0"}
    # This node restarted for a peer's failure: its own restart count stays 0, the job's attempt is 1.
    agreed.value = 1
    assert {env[ATTEMPT_VAR] for env in reify(logs, 0).values()} == {"1"}
    assert announced == [
        (0, {2: str(tmp_path / "rank2"), 3: str(tmp_path / "rank3")}),
        (1, {2: str(tmp_path / "restart1" / "rank2"), 3: str(tmp_path / "restart1" / "rank3")}),
    ]


def test_without_an_agreed_number_attempts_started_here_are_counted(tmp_path: Path) -> None:
    """The static rendezvous has no rounds: the node's own count of started attempts stands in."""
    logs = RunDirLogs(str(tmp_path), lambda *args: None)
    assert [reify(logs, count)[0][ATTEMPT_VAR] for count in (0, 1, 2)] == ["0", "1", "2"]
