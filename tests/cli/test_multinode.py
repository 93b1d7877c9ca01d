"""Two-node jobs across two network-namespace "hosts" (testbed/netns.py), unshaped and at 1 Gbit/s.

Each host is its own network stack with one veth on a shared bridge (10.X.Y.0/24); the job's traffic goes
over that link, not loopback. The tiny training's parameters must be bitwise those of a single-node run
with the same world size (`lockstep run -n 2` on this machine). Skipped, with the reason, only where the
machine cannot create namespaces (not root, no iproute2).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from testbed.netns import Host, netns_hosts, unavailable_reason
from tests.helpers import TINY, child_env, result_line
from tests.helpers import TINY_STEPS as STEPS

RUN_TIMEOUT = 90.0

pytestmark = pytest.mark.timeout(200)


@pytest.fixture(scope="module", autouse=True)
def namespaces_possible() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no network-namespace hosts on this machine: {reason}")


def run_on_both(
    hosts: Sequence[Host], commands: Sequence[list[str]], envs: Sequence[dict[str, str]], cwd: Path
) -> list[tuple[int, str, str]]:
    """Start one command per host at once; wait for all (killing every one on a hang); (rc, out, err) each."""
    procs = [
        host.popen(cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for host, cmd, env in zip(hosts, commands, envs)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                import os
                import signal

                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def tbf_bytes_sent(host: Host) -> int:
    """Bytes that went out through the host's tbf qdisc (0 when there is none)."""
    out = host.run(["tc", "-s", "qdisc", "show", "dev", host.ifname]).stdout
    if "tbf" not in out:
        return 0
    return int(out.split("Sent ", 1)[1].split()[0])


def test_two_hosts_explicit_env_match_single_node(tmp_path: Path, tiny_reference: dict[str, str]) -> None:
    """lockstep.init(rank=..., world_size=...) with MASTER_ADDR on host 0 and gloo bound to the veth."""
    with netns_hosts(2) as hosts:
        port = hosts[0].free_port()  # rank 0 binds it on host 0
        base = {
            "MASTER_ADDR": hosts[0].addr,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
        }
        envs = [{**base, "RANK": str(i), "GLOO_SOCKET_IFNAME": h.ifname} for i, h in enumerate(hosts)]
        cmd = [sys.executable, str(TINY), "--explicit", "--steps", STEPS]
        results = run_on_both(hosts, [cmd, cmd], envs, tmp_path)
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert f"rank 1/2 local 1/2 node 0/1 via explicit endpoint {hosts[0].addr}:{port}" in results[1][1]
    assert result_line(results[0][1]) == tiny_reference


def launcher_commands(hosts: Sequence[Host], run_dir: Path, *, interface: bool = True) -> list[list[str]]:
    endpoint = f"{hosts[0].addr}:{hosts[0].free_port()}"  # host 0's launcher hosts the rendezvous
    return [
        [
            sys.executable,
            "-m",
            "lockstep",
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            str(i),
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "multinode-test",
            "--local-addr",
            host.addr,
            *(["--network-interface", host.ifname] if interface else []),
            "-n",
            "1",
            "--run-dir",
            str(run_dir / f"node{i}"),
            str(TINY),
            "--steps",
            STEPS,
        ]
        for i, host in enumerate(hosts)
    ]


@pytest.mark.parametrize("rate", [None, "1gbit"], ids=["unshaped", "1gbit"])
def test_lockstep_run_two_nodes_matches_single_node(
    tmp_path: Path, tiny_reference: dict[str, str], rate: str | None
) -> None:
    """`lockstep run --nnodes 2 --node-rank i --rdzv-endpoint HOST0:PORT --local-addr ... --network-interface ...`."""
    with netns_hosts(2, rate=rate) as hosts:
        results = run_on_both(hosts, launcher_commands(hosts, tmp_path), [child_env()] * 2, tmp_path)
        sent = [tbf_bytes_sent(host) for host in hosts]
    assert [rc for rc, _, _ in results] == [0, 0], results
    for i, (_, out, err) in enumerate(results):
        assert "1 process x 2 nodes (world 2)" in err and f"network interface {hosts[i].ifname})" in err
        assert f"rank {i}/2 local 0/1 node {i}/2 via torchrun" in (
            out if i == 0 else (tmp_path / "node1" / "rank1" / "stdout.log").read_text()
        )
    assert result_line(results[0][1]) == tiny_reference
    if rate:
        # The job's traffic went through the rate-limited link, both ways.
        assert all(count > 20_000 for count in sent), sent


def test_local_addr_alone_picks_the_interface_that_holds_it(
    tmp_path: Path, tiny_reference: dict[str, str]
) -> None:
    """Without --network-interface, gloo would bind to what the host name resolves to (127.0.0.1 here) and
    tell the other node to connect there: a hang until the init timeout. --local-addr names the address;
    the launcher finds its interface (the veth) and sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME from it."""
    with netns_hosts(2) as hosts:
        commands = launcher_commands(hosts, tmp_path, interface=False)
        results = run_on_both(
            hosts, commands, [child_env(GLOO_SOCKET_IFNAME=None, NCCL_SOCKET_IFNAME=None)] * 2, tmp_path
        )
    assert [rc for rc, _, _ in results] == [0, 0], results
    for host, (_, _, err) in zip(hosts, results):
        assert f"network interface {host.ifname} (it holds --local-addr {host.addr})" in err, err
    assert result_line(results[0][1]) == tiny_reference


def test_node_failure_restarts_both_nodes_and_resumes(tmp_path: Path, tiny_reference: dict[str, str]) -> None:
    """SIGKILL the worker on node 1 mid-training under --max-restarts 1: both nodes restart their workers,
    which resume from the last checkpoint (on the shared filesystem) and end with the single-node parameters."""
    import os
    import signal
    import time

    progress, ckpt = tmp_path / "progress", tmp_path / "ckpt"
    extra = ["--ckpt-dir", str(ckpt), "--ckpt-every", "5", "--sleep", "0.2", "--progress", str(progress)]
    with netns_hosts(2) as hosts:
        commands = [
            [*cmd[:4], "--max-restarts", "1", *cmd[4:], *extra] for cmd in launcher_commands(hosts, tmp_path)
        ]
        procs = [
            host.popen(
                cmd, env=child_env(), cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for host, cmd in zip(hosts, commands)
        ]
        try:
            deadline = time.monotonic() + RUN_TIMEOUT
            while not (progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= 7):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no progress"
                time.sleep(0.1)
            victim = int((tmp_path / "node1" / "rank1" / "pid").read_text())
            os.kill(victim, signal.SIGKILL)
            outputs = [proc.communicate(timeout=60) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    # Both nodes start attempt 1 (node 0 perhaps only because node 1's rendezvous reopened: then it says so).
    assert all("lockstep run: restart 1" in err for _, err in outputs), outputs
    for node in (0, 1):
        assert (tmp_path / f"node{node}" / "restart1" / f"rank{node}" / "stdout.log").exists()
    result = result_line(outputs[0][0])
    assert int(result.pop("resumed_from")) >= 5
    assert result == {k: v for k, v in tiny_reference.items() if k != "resumed_from"}
