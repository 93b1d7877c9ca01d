"""The public surface is pinned: `lockstep.__all__`, the CLI's commands and `lockstep run`'s flags.

Changing any of these is a deliberate act: update the pin here together with README/DESIGN.md.
"""

from __future__ import annotations

import lockstep
from lockstep import cli
from lockstep.launch.spec import build_parser

PUBLIC_NAMES = [
    "DistributedDataParallel", "SyncPolicy", "Topology", "__version__", "all_reduce_mean", "barrier",
    "broadcast_object", "checkpoint", "data", "engine", "errors", "fit", "get_logger", "hooks", "init",
    "is_main", "main_process_first", "nn", "replicate", "runtime", "shutdown", "testing", "trainer",
]

RUN_FLAGS = {
    "-h", "--help",
    "-n", "--nproc-per-node", "--nproc_per_node",  # torchrun's names
    "--nnodes",
    "--node-rank", "--node_rank",
    "--rdzv-endpoint", "--rdzv_endpoint",
    "--rdzv-id", "--rdzv_id",
    "--rdzv-backend", "--rdzv_backend",
    "--rdzv-conf", "--rdzv_conf",
    "--standalone",
    "--local-addr", "--local_addr",
    "--max-restarts", "--max_restarts",
    "--monitor-interval", "--monitor_interval",
    "--run-dir", "--log-dir", "--log_dir",
    "-m", "--module",
    # lockstep's own
    "--network-interface", "--logs", "--env", "--verbose",
}


def test_all_is_pinned() -> None:
    assert sorted(lockstep.__all__) == sorted(PUBLIC_NAMES)


def test_run_flags_are_pinned() -> None:
    flags = {option for action in build_parser()._actions for option in action.option_strings}
    assert flags == RUN_FLAGS


def test_run_defaults() -> None:
    ns = build_parser().parse_args(["s.py"])
    assert (ns.nproc_per_node, ns.nnodes, ns.max_restarts, ns.logs, ns.rdzv_backend) == ("1", "1", 0, "rank0", "c10d")


def test_cli_commands_are_pinned() -> None:
    assert set(cli._COMMANDS) == {"run", "slurm", "env", "train"}
    assert cli._PLANNED == {}
