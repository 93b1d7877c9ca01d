"""SLURM across two "hosts": two slurmd nodes in two network namespaces, each with its own hostname.

The nodes (node0, node1) are testbed/netns.py hosts; each slurmd runs in its own network, UTS and
mount namespace with an /etc/hosts that names both nodes, so names resolve as on a real cluster and no
lockstep flag is needed for addresses. Checks: `srun -N2 -n2` maps SLURM's variables across nodes, and
`lockstep slurm --nodes 2` (one `lockstep run` per node, node0 hosting the rendezvous) trains to the
same parameters as a single-node run. Skipped, with the reason, only where the machine cannot host it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import netns
from testbed.slurm_cluster import SlurmCluster, slurm_cluster
from testbed.slurm_cluster import unavailable_reason as slurm_unavailable
from tests.helpers import JOB_TIMEOUT, TINY, result_line, slurm_cli
from tests.helpers import TINY_STEPS as STEPS

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = slurm_unavailable() or netns.unavailable_reason()
    if reason:
        pytest.skip(f"no two-node SLURM cluster on this machine: {reason}")
    with (
        netns.netns_hosts(2) as hosts,
        slurm_cluster(tmp_path_factory.mktemp("slurm2") / "cluster", hosts=hosts, cpus=1) as running,
    ):
        yield running


def test_srun_across_two_nodes(cluster: SlurmCluster, tmp_path: Path, tiny_reference: dict[str, str]) -> None:
    out = cluster.run(
        ["srun", "-N2", "-n2", sys.executable, str(TINY), "--steps", STEPS],
        cwd=tmp_path,
        timeout=JOB_TIMEOUT,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr + cluster.logs()
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    port = re.search(r"endpoint node0:(\d+)", lines[0]).group(1)  # type: ignore[union-attr]
    assert lines == [
        f"rank 0/2 local 0/1 node 0/2 via slurm endpoint node0:{port}",
        f"rank 1/2 local 0/1 node 1/2 via slurm endpoint node0:{port}",
    ]
    assert result_line(out.stdout) == tiny_reference


def test_lockstep_slurm_two_nodes_matches_local_run(
    cluster: SlurmCluster, tmp_path: Path, tiny_reference: dict[str, str]
) -> None:
    out = slurm_cli(
        cluster, "--nodes", "2", "-n", "1", "--run-dir", "r", str(TINY), "--steps", STEPS, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    job = int(re.search(r"submitted job (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
    info = cluster.wait(job, timeout=JOB_TIMEOUT)
    text = (tmp_path / "r" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "node[0-1]", f"{info}\n{text}"
    assert f"rendezvous node0:{15000 + job % 20000}" in text
    assert text.count("1 process x 2 nodes (world 2)") == 2, text  # one lockstep run per node
    rank1 = (tmp_path / "r" / "logs" / f"{job}.0" / "rank1" / "stdout.log").read_text()
    assert "rank 1/2 local 0/1 node 1/2 via torchrun" in rank1
    assert result_line(text) == tiny_reference
