"""Which interface gloo and nccl use on a node (launch/netif.py, local.collective_interface): pure rules, and
this machine's real interfaces (`lo` holds 127.0.0.1 everywhere Linux runs). The 2-node runs that need it
are in tests/cli/test_multinode.py."""

from __future__ import annotations

import sys

import pytest

from lockstep.launch.agent_config import collective_interface
from lockstep.launch.agent_config import worker_env as _worker_env
from lockstep.launch.netif import interface_addresses, interface_for
from lockstep.launch.spec import LaunchSpec

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIOCGIFADDR is Linux's")


@linux_only
def test_interface_that_holds_an_address() -> None:
    assert interface_addresses()["lo"] == "127.0.0.1"
    assert interface_for("127.0.0.1") == "lo" and interface_for("localhost") == "lo"
    assert interface_for("198.51.100.254") is None  # TEST-NET-2: documentation only, held by no interface
    assert interface_for("no-such-host.invalid") is None


def node(**fields: object) -> LaunchSpec:
    base: dict[str, object] = {
        "entrypoint": "s.py",
        "min_nodes": 2,
        "max_nodes": 2,
        "rdzv_endpoint": "127.0.0.1:29400",
    }
    return LaunchSpec(**{**base, **fields})  # type: ignore[arg-type]


@linux_only
def test_local_addr_picks_the_interface_unless_told() -> None:
    assert collective_interface(node(local_addr="127.0.0.1"), {}) == (
        "lo",
        "network interface lo (it holds --local-addr 127.0.0.1)",
    )
    # --network-interface wins; without --local-addr, or on one node, nothing is guessed.
    assert collective_interface(node(local_addr="127.0.0.1", network_interface="ib0"), {})[0] == "ib0"
    assert collective_interface(node(), {}) == (None, "")
    assert collective_interface(LaunchSpec("s.py", local_addr="127.0.0.1"), {}) == (None, "")
    # The user's own settings stay: both set (in the environment or by --env) -> nothing to add.
    both = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib0"}
    assert collective_interface(node(local_addr="127.0.0.1"), both) == (None, "")
    assert collective_interface(node(local_addr="127.0.0.1", env=both), {}) == (None, "")
    # An address no interface holds (e.g. behind NAT): nothing is set, gloo decides as before.
    assert collective_interface(node(local_addr="198.51.100.254"), {}) == (None, "")


def test_worker_env_sets_both_variables_and_keeps_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    env = _worker_env(node(local_addr="10.0.0.2"), "1", "eth1")
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("eth1", "ib0")
    env = _worker_env(node(network_interface="veth1"), "1", "veth1")  # the flag says it for both
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("veth1", "veth1")
    assert "GLOO_SOCKET_IFNAME" not in _worker_env(node(), "1", None)
