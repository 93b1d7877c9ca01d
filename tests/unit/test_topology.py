"""Topology from torchrun, SLURM, explicit arguments and nothing at all; hostlists; bad environments."""

from __future__ import annotations

import pytest

from lockstep.errors import ConfigError
from lockstep.runtime.env.topology import (
    Topology,
    detect_launcher,
    expand_hostlist,
    expand_tasks_per_node,
    resolve_topology,
    slurm_port,
)

TORCHRUN_ENV = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "abc",
}

# What `srun -N3 --ntasks-per-node=2 python train.py` exports to task 3 (second task of the second node).
SLURM_ENV = {
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "6",
    "SLURM_STEP_NUM_TASKS": "6",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "3",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_TASKS_PER_NODE": "2(x3)",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
    "SLURM_JOB_NODELIST": "gpu[01-02,07]",
    "SLURM_STEP_NODELIST": "gpu[01-02,07]",
    "SLURM_NODELIST": "gpu[01-02,07]",
}


def test_nothing_is_a_world_of_one() -> None:
    topo = resolve_topology({})
    assert topo == Topology()
    assert (topo.rank, topo.world_size, topo.is_main, topo.is_distributed, topo.launcher) == (
        0,
        1,
        True,
        False,
        "none",
    )


def test_torchrun_variables() -> None:
    topo = resolve_topology(TORCHRUN_ENV)
    assert (topo.rank, topo.local_rank, topo.world_size, topo.local_world_size) == (5, 1, 8, 4)
    assert (topo.node_rank, topo.num_nodes, topo.endpoint, topo.launcher) == (
        1,
        2,
        "10.0.0.1:29400",
        "torchrun",
    )
    assert not topo.is_main


def test_explicit_arguments_like_the_tutorials_setup() -> None:
    topo = resolve_topology({"MASTER_ADDR": "localhost", "MASTER_PORT": "12355"}, rank=1, world_size=2)
    assert (topo.rank, topo.world_size, topo.local_rank, topo.launcher) == (1, 2, 1, "explicit")
    assert topo.endpoint == "localhost:12355"


def test_slurm_srun_step() -> None:
    topo = resolve_topology(SLURM_ENV)
    assert (topo.rank, topo.local_rank, topo.world_size, topo.local_world_size) == (3, 1, 6, 2)
    assert (topo.node_rank, topo.num_nodes, topo.master_addr, topo.launcher) == (1, 3, "gpu01", "slurm")
    assert topo.master_port == slurm_port(123456) == 15000 + 123456 % 20000


def test_slurm_master_addr_and_port_can_be_overridden() -> None:
    topo = resolve_topology({**SLURM_ENV, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert topo.endpoint == "head:4000"


def test_slurm_batch_script_outside_srun_is_not_a_rank() -> None:
    batch = {k: v for k, v in SLURM_ENV.items() if not k.startswith("SLURM_STEP")}
    assert detect_launcher(batch) == "none"
    assert detect_launcher({**batch, "SLURM_STEP_ID": "4294967294"}) == "none"
    assert resolve_topology(batch).world_size == 1


def test_slurm_uneven_tasks_per_node() -> None:
    env = {
        **SLURM_ENV,
        "SLURM_NODEID": "2",
        "SLURM_PROCID": "4",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_NTASKS": "5",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    }
    topo = resolve_topology(env)
    assert (topo.world_size, topo.local_world_size, topo.node_rank) == (5, 1, 2)


def test_torchrun_wins_over_slurm_under_lockstep_run_inside_an_allocation() -> None:
    topo = resolve_topology({**SLURM_ENV, **TORCHRUN_ENV})
    assert topo.launcher == "torchrun" and topo.rank == 5


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a[1-2],b[08-10]", ["a1", "a2", "b08", "b09", "b10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("n[9-11].cluster", ["n9.cluster", "n10.cluster", "n11.cluster"]),
    ],
)
def test_expand_hostlist(hostlist: str, expected: list[str]) -> None:
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu[a-b]", ""])
def test_bad_hostlists_are_named(bad: str) -> None:
    with pytest.raises(ConfigError):
        expand_hostlist(bad)


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="tasks-per-node"):
        expand_tasks_per_node("2x3")


def test_rank_without_world_size_is_a_partial_environment() -> None:
    with pytest.raises(ConfigError, match=r"partial launcher environment.*WORLD_SIZE is missing"):
        resolve_topology({"RANK": "0"})


def test_rank_outside_the_world() -> None:
    with pytest.raises(ConfigError, match=r"rank 4 is outside the world of 4 processes"):
        resolve_topology({**TORCHRUN_ENV, "RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match=r"rank 2 is outside the world of 2"):
        resolve_topology({"MASTER_ADDR": "x", "MASTER_PORT": "1"}, rank=2, world_size=2)


def test_explicit_rank_needs_master_address() -> None:
    with pytest.raises(ConfigError, match=r"MASTER_ADDR/MASTER_PORT are not set"):
        resolve_topology({}, rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"pass both or neither"):
        resolve_topology({}, rank=0)


def test_non_integer_and_out_of_range_values() -> None:
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='two' is not an integer"):
        resolve_topology({"RANK": "0", "WORLD_SIZE": "two"})
    with pytest.raises(ConfigError, match=r"MASTER_PORT=70000 is not a TCP port"):
        resolve_topology({**TORCHRUN_ENV, "MASTER_PORT": "70000"})


def test_slurm_without_nodelist_or_master() -> None:
    env = {k: v for k, v in SLURM_ENV.items() if "NODELIST" not in k}
    with pytest.raises(ConfigError, match=r"head node is unknown"):
        resolve_topology(env)


def test_agent_store_attempt_is_the_jobs_attempt_under_lockstep_run() -> None:
    """LOCKSTEP_ATTEMPT (the job's attempt, the same on every node) wins over this node's restart count."""
    agent = {**TORCHRUN_ENV, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert resolve_topology({**agent, "LOCKSTEP_ATTEMPT": "1"}).agent_store_attempt == 1
    # Plain torchrun: only the restart count exists.
    assert resolve_topology({**agent, "TORCHELASTIC_RESTART_COUNT": "2"}).agent_store_attempt == 2
    # No agent store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or not under the agent): no prefix at all.
    assert resolve_topology({**TORCHRUN_ENV, "LOCKSTEP_ATTEMPT": "1"}).agent_store_attempt is None
    with pytest.raises(ConfigError, match="LOCKSTEP_ATTEMPT"):
        resolve_topology({**agent, "LOCKSTEP_ATTEMPT": "x"})


def _node(local_rank: int, local_world: int, launcher: str = "torchrun") -> Topology:
    return Topology(
        rank=local_rank,
        local_rank=local_rank,
        world_size=local_world,
        local_world_size=local_world,
        launcher=launcher,
    )


def test_local_cuda_index_one_process_per_device() -> None:
    from lockstep.runtime.process_group import local_cuda_index

    assert [local_cuda_index(_node(i, 4), None, 4, None) for i in range(4)] == [0, 1, 2, 3]
    assert [local_cuda_index(_node(i, 2), "nccl", 8, "0,1,2,3,4,5,6,7") for i in range(2)] == [0, 1]
    assert local_cuda_index(_node(1, 2), "gloo", 4, None) is None  # gloo picks no device
    assert local_cuda_index(_node(0, 1), None, 0, None) is None  # no CUDA device at all


def test_local_cuda_index_task_with_its_own_device() -> None:
    """srun --gpus-per-task=1: each of 4 tasks sees one device (its own), so each drives cuda:0."""
    from lockstep.runtime.process_group import local_cuda_index

    for local_rank, visible in enumerate(["0", "1", "2", "3"]):
        assert local_cuda_index(_node(local_rank, 4, "slurm"), "nccl", 1, visible) == 0
        assert local_cuda_index(_node(local_rank, 4, "slurm"), None, 1, visible) == 0
    # A launcher that gives each process its own device and says LOCAL_RANK=0 (torch's virtual local rank).
    assert local_cuda_index(_node(0, 4), None, 1, "3") == 0


@pytest.mark.parametrize(
    ("local_rank", "backend", "count", "visible"),
    [
        (3, None, 2, None),  # 4 processes, 2 devices: backend None means nccl on CUDA
        (1, "nccl", 2, "0,1"),
        (2, None, 1, "0"),  # every process of the node inherited the one device: local rank 2 shares it
        (1, "nccl", 1, None),
    ],
)
def test_local_cuda_index_more_processes_than_devices_says_what_to_change(
    local_rank: int, backend: str | None, count: int, visible: str | None
) -> None:
    from lockstep.runtime.process_group import local_cuda_index

    with pytest.raises(ConfigError) as err:
        local_cuda_index(_node(local_rank, 4), backend, count, visible)
    message = str(err.value)
    assert message.startswith(
        f"[rank {local_rank}/4] 4 processes on this node but only {count} CUDA device(s)"
    )
    assert (
        f"lockstep run -n {count}" in message
        and "--gpus-per-task=1" in message
        and "backend='gloo'" in message
    )
    assert local_cuda_index(_node(local_rank, 4), "gloo", count, visible) is None  # gloo: the way out
