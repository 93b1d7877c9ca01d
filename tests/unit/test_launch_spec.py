"""`lockstep run` argument parsing and validation (pure: no process is started)."""

from __future__ import annotations

import re

import pytest

from lockstep.errors import ConfigError
from lockstep.launch.agent_config import omp_threads, rendezvous_conf, usable_cores
from lockstep.launch.flag_values import parse_endpoint
from lockstep.launch.spec import LaunchSpec, check_entrypoint, parse_run_args


def test_script_args_pass_through_untouched() -> None:
    spec = parse_run_args(["-n", "2", "script.py", "--lr", "3", "-n", "5"])
    assert spec.nproc_per_node == 2
    assert spec.entrypoint == "script.py"
    assert spec.args == ("--lr", "3", "-n", "5")
    assert not spec.module


def test_script_flags_that_look_like_ours_stay_the_scripts() -> None:
    spec = parse_run_args(["script.py", "--help", "--nnodes", "4", "-m", "x", "--", "y"])
    assert spec.args == ("--help", "--nnodes", "4", "-m", "x", "--", "y")
    assert spec.nproc_per_node == 1 and spec.max_nodes == 1


@pytest.mark.parametrize("flag", [["-n", "3"], ["-n3"], ["--nproc-per-node", "3"], ["--nproc_per_node=3"]])
def test_torchrun_spellings_of_nproc(flag: list[str]) -> None:
    assert parse_run_args([*flag, "s.py"]).nproc_per_node == 3


def test_module_mode() -> None:
    spec = parse_run_args(["-n", "2", "-m", "pkg.train", "--epochs", "1"])
    assert spec.module and spec.entrypoint == "pkg.train" and spec.args == ("--epochs", "1")


def test_multi_node_flags() -> None:
    spec = parse_run_args(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "10.0.0.1:29500",
            "--rdzv-id",
            "job7",
            "--rdzv-conf",
            "join_timeout=30,last_call_timeout=1",
            "--local-addr",
            "10.0.0.2",
            "--network-interface",
            "veth1",
            "--max-restarts",
            "2",
            "s.py",
        ]
    )
    assert (spec.min_nodes, spec.max_nodes, spec.node_rank) == (2, 2, 1)
    assert spec.endpoint == "10.0.0.1:29500" and spec.rdzv_id == "job7"
    assert dict(spec.rdzv_conf) == {"join_timeout": "30", "last_call_timeout": "1"}
    assert spec.local_addr == "10.0.0.2" and spec.network_interface == "veth1" and spec.max_restarts == 2
    # node 1 is not the store host; node 0 is (what two network namespaces needed, TESTBED.md)
    assert rendezvous_conf(spec)["is_host"] == "0"
    spec0 = parse_run_args(["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "10.0.0.1:29500", "s.py"])
    assert rendezvous_conf(spec0)["is_host"] == "1"
    explicit = parse_run_args(
        ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--rdzv-conf", "is_host=0", "s.py"]
    )
    assert rendezvous_conf(explicit)["is_host"] == "0"


def test_elastic_nnodes_range() -> None:
    spec = parse_run_args(["--nnodes", "1:3", "--rdzv-endpoint", "h:29400", "s.py"])
    assert (spec.min_nodes, spec.max_nodes) == (1, 3)


def test_single_node_uses_a_kernel_chosen_port() -> None:
    spec = parse_run_args(["-n", "2", "s.py"])
    assert spec.endpoint == "127.0.0.1:0" and not spec.is_multi_node
    assert parse_run_args(["--standalone", "s.py"]).rdzv_endpoint is None


def test_env_and_logs_options() -> None:
    spec = parse_run_args(["--env", "A=1", "--env", "B=x=y", "--logs", "all", "--run-dir", "out", "s.py"])
    assert dict(spec.env) == {"A": "1", "B": "x=y"}
    assert spec.logs == "all" and spec.run_dir == "out"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-n", "0", "s.py"], "-n/--nproc-per-node must be an integer >= 1, got 0"),
        (["-n", "two", "s.py"], "-n/--nproc-per-node must be an integer >= 1, got 'two'"),
        ([], "no script given"),
        (["--nnodes", "2", "s.py"], "needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "x", "s.py"], "--nnodes 'x' is not N or MIN:MAX"),
        (["--nnodes", "3:2", "--rdzv-endpoint", "h:1", "s.py"], "MIN > MAX"),
        (["--rdzv-endpoint", "host:abc", "s.py"], "port 'abc', which is not a TCP port"),
        (["--rdzv-endpoint", "host:70000", "s.py"], "not a TCP port"),
        (["--rdzv-endpoint", ":29400", "s.py"], "has no host"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:0", "s.py"], "has port 0"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "s.py"],
            "--node-rank 2 is outside 0..1",
        ),
        (["--max-restarts", "-1", "s.py"], "--max-restarts must be an integer >= 0"),
        (["--logs", "some", "s.py"], "invalid choice: 'some'"),
        (["--env", "NOVALUE", "s.py"], "--env 'NOVALUE' is not KEY=VALUE"),
        (["--rdzv-conf", "oops", "s.py"], "--rdzv-conf 'oops' is not KEY=VALUE"),
        (["--standalone", "--nnodes", "2", "s.py"], "--standalone is for one node"),
        (["--bogus", "s.py"], "unrecognized arguments: --bogus"),
        (["--nproc", "2", "s.py"], "unrecognized arguments"),  # no silent abbreviations
    ],
)
def test_bad_input_names_what_to_fix(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_run_args(argv)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h:1", ("h", 1)),
        ("h", ("h", 29400)),
        ("[::1]:5", ("::1", 5)),
        ("10.0.0.1:29500", ("10.0.0.1", 29500)),
    ],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


def test_ipv6_without_brackets_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"\[addr\]:port"):
        parse_endpoint("::1:29400")


def test_python_api_validates_too() -> None:
    with pytest.raises(ConfigError, match="nproc-per-node"):
        LaunchSpec("s.py", nproc_per_node=0)
    with pytest.raises(ConfigError, match="--logs"):
        LaunchSpec("s.py", logs="everything")


def test_entrypoint_must_exist(tmp_path) -> None:
    (tmp_path / "ok.py").write_text("print(1)\n")
    check_entrypoint(LaunchSpec("ok.py"), str(tmp_path))
    with pytest.raises(ConfigError, match="script 'missing.py' not found"):
        check_entrypoint(LaunchSpec("missing.py"), str(tmp_path))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    check_entrypoint(LaunchSpec("pkg.mod", module=True), str(tmp_path))
    with pytest.raises(ConfigError, match="module 'nopkg_xyz.mod' .* was not found"):
        check_entrypoint(LaunchSpec("nopkg_xyz.mod", module=True), str(tmp_path))


def test_threads_default_to_cores_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = usable_cores()
    assert omp_threads(LaunchSpec("s.py", nproc_per_node=1))[0] == str(cores)
    assert omp_threads(LaunchSpec("s.py", nproc_per_node=cores * 4))[0] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert omp_threads(LaunchSpec("s.py", nproc_per_node=2)) == ("7", "OMP_NUM_THREADS=7 (set by you)")
    assert omp_threads(LaunchSpec("s.py", nproc_per_node=2, env={"OMP_NUM_THREADS": "5"}))[0] == "5"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2", "--min-world", "3", "t.py"], "--min-world 3 is more than the 2 processes"),
        (["-n", "2", "--min-world", "0", "t.py"], "--min-world must be an integer >= 1"),
        (
            ["-n", "2", "--min-world", "1", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "t.py"],
            "--min-world on several nodes needs --node-rank I on each node",
        ),
        (
            [
                "-n",
                "2",
                "--min-world",
                "5",
                "--nnodes",
                "2",
                "--node-rank",
                "0",
                "--rdzv-endpoint",
                "h:1",
                "t.py",
            ],
            "--min-world 5 is more than the 4 processes started (-n) on 2 nodes",
        ),
        (
            ["-n", "2", "--min-world", "2", "--nnodes", "1:2", "--rdzv-endpoint", "h:29400", "t.py"],
            "needs a fixed number of nodes, got --nnodes 1:2",
        ),
    ],
)
def test_min_world_flag_is_checked(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_run_args(argv)


def test_min_world_flag_sets_live_mode() -> None:
    assert parse_run_args(["-n", "4", "--min-world", "2", "t.py"]).min_world == 2
    two_nodes = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29400"]
    assert parse_run_args(["-n", "2", "--min-world", "3", *two_nodes, "t.py"]).min_world == 3
    assert parse_run_args(["-n", "4", "t.py"]).min_world is None
    replacements = parse_run_args(["-n", "4", "--min-world", "2", "--max-restarts", "3", "t.py"])
    assert (replacements.min_world, replacements.max_restarts) == (2, 3)  # live mode: 3 replacements
