"""Start one node's workers with torch's elastic agent and supervise them: `launch(spec) -> exit code`.

Python API (what `lockstep run` and `lockstep train` call)::

    from lockstep.launch.spec import LaunchSpec
    from lockstep.launch.local import launch

    code = launch(LaunchSpec("train.py", args=("--lr", "3"), nproc_per_node=2, run_dir="runs/a"))

`launch` builds a `torch.distributed.launcher.api.LaunchConfig` and calls `elastic_launch`: torch's agent
starts the workers (each in its own session, so one `killpg` reaches its DataLoader workers too), runs the
c10d rendezvous and monitors them. We add only what torch leaves out, each in its own module:

- agent_config: the run directory, OMP_NUM_THREADS, the rendezvous settings (c10d on 127.0.0.1 port 0 for
  one node), the LaunchConfig and the workers' environment;
- worker: each worker runs under `lockstep.launch.worker`, which keeps the script's argv untouched and
  records its traceback where the agent reads it;
- rank_logs: per-rank logs in the run directory (`<run_dir>/rank<R>/{stdout,stderr}.log`,
  `restart<k>/rank<R>` after a restart), relayed to the console by console_relay;
- console_lines: the header, restart and multi-node waiting lines; failure_report: one failure summary;
- signals: Ctrl-C / SIGTERM make torch's agent forward the signal to every worker's process group and
  SIGKILL them after `spec.shutdown_grace` seconds (a script that handles SIGTERM gets that grace to save
  its state and exit); SIGUSR1 / SIGUSR2 are passed on to every worker and the run goes on (SLURM's
  `--signal=USR1@T` before the time limit reaches the training script);
- process_sweep: at the end every worker's process group is SIGKILLed again, by the pids the workers
  wrote, so that nothing outlives the launcher.

The exit code: 0 on success, the first failing rank's exit code (128 + signal if it was killed), 128 +
signal when the launcher itself is interrupted.

Multi-node: `--nnodes`, `--rdzv-endpoint`, `--rdzv-id`, `--rdzv-conf`, `--local-addr` go to the agent
unchanged; `--node-rank 0` / `N` become `is_host=1` / `0` for the c10d store unless `--rdzv-conf` says,
and `--network-interface` sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for the workers (without it, the
interface that holds `--local-addr`, unless those are set). The c10d rendezvous is torch's, wrapped
(launch/rendezvous.py) so that every node numbers a restart the same way: after one node's failure all
nodes restart, and their workers meet under the same attempt number.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lockstep.errors import LaunchError
from lockstep.launch.agent_config import (
    check_endpoint_free,
    collective_interface,
    launch_config,
    make_run_dir,
    omp_threads,
    quiet_agent_logs,
    rendezvous_conf,
    worker_env,
    worker_environ,
)
from lockstep.launch.console_lines import attempt_line, goodput_line, waiting_line
from lockstep.launch.console_relay import Console, ConsoleRelay
from lockstep.launch.failure_report import (
    RankFailure,
    first_failure,
    format_failure,
    format_hang_failure,
    read_hang_report,
)
from lockstep.launch.process_sweep import StoppedWorkerWaker, kill_leftovers
from lockstep.launch.spec import LaunchSpec, check_entrypoint


@dataclass
class LaunchState:
    """What the launcher learns from each attempt that torch's agent starts on this node."""

    world_size: int | None = None  # the job's, from the latest attempt (None before the first)
    rank_dirs: dict[int, str] = field(default_factory=dict)  # global rank -> its directory, latest attempt
    all_dirs: list[str] = field(default_factory=list)  # every attempt's rank directories: the final sweep's

    def record(self, ranks: Mapping[int, str], env0: Mapping[str, str]) -> None:
        """An attempt started: `ranks` maps its global ranks to their directories; `env0` is the
        environment of its first worker."""
        from lockstep.runtime.env.env_contract import WORLD_SIZE_VAR  # lockstep.runtime loads torch: only now

        self.world_size = int(env0.get(WORLD_SIZE_VAR, "0")) or None
        self.rank_dirs.update(ranks)
        self.all_dirs.extend(ranks.values())

    def attempt_dir(self) -> str | None:
        """The directory of this node's current attempt (the parent of its rank directories)."""
        return os.path.dirname(next(iter(self.rank_dirs.values()))) if self.rank_dirs else None

    def current_dirs(self) -> list[str]:
        """The rank directories of this node's current attempt (where its workers wrote their pids)."""
        return list(self.rank_dirs.values())


def launch(spec: LaunchSpec, *, cwd: str | None = None, console: Console | None = None) -> int:
    """Run `spec` on this node; return the exit code (see the module doc). Raises ConfigError on bad input."""
    if spec.min_world is not None:
        from lockstep.launch.live_launch import launch_live

        return launch_live(spec, cwd=cwd, console=console)
    cwd = cwd or os.getcwd()
    check_entrypoint(spec, cwd)
    console = console or Console(sys.stdout, sys.stderr)
    run_dir = make_run_dir(spec.run_dir, cwd)
    threads, threads_note = omp_threads(spec)
    rdzv_conf = rendezvous_conf(spec)
    if spec.is_multi_node:
        check_endpoint_free(spec, rdzv_conf)
    relay = ConsoleRelay(console, logs=spec.logs)
    state = LaunchState()

    def on_attempt(attempt: int, ranks: Mapping[int, str], env0: Mapping[str, str]) -> None:
        state.record(ranks, env0)
        console.line("stderr", attempt_line(spec, attempt, ranks, env0, threads_note, run_dir))
        for rank, rank_dir in sorted(ranks.items()):
            relay.follow(rank, os.path.join(rank_dir, "stdout.log"), os.path.join(rank_dir, "stderr.log"))

    interface, interface_note = collective_interface(spec, os.environ)
    if spec.is_multi_node:
        console.line("stderr", waiting_line(spec, interface_note, run_dir))
    config = launch_config(spec, run_dir, rdzv_conf, on_attempt)
    # Loads torch's agent: only once the checks above have passed, so that a bad input fails at once.
    from lockstep.launch.signals import forward_signals, held_signals, signals_raise

    relay.start()
    code, report = 1, ""
    with (
        worker_environ(worker_env(spec, threads, interface)),
        signals_raise(),
        forward_signals(state.current_dirs),
        quiet_agent_logs(spec.verbose),
        StoppedWorkerWaker(state.current_dirs),
    ):
        try:
            code, report = _run_agent(config, spec, state)
        finally:
            # With signals held off (a second Ctrl-C must not cut it short): kill what is left, drain the logs.
            with held_signals():
                kill_leftovers(state.all_dirs)
                relay.stop()
    if code == 0:
        report = goodput_line(dir for _, dir in sorted(state.rank_dirs.items())) or report
    if report:
        console.line("stderr", report)  # after the relay drained: the summary is the last thing shown
    return code


def _run_agent(config: Any, spec: LaunchSpec, state: LaunchState) -> tuple[int, str]:
    """Run torch's agent; return (exit code, final report)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    kind = "module" if spec.module else "script"
    try:
        elastic_launch(config, sys.executable)(
            "-m", "lockstep.launch.worker", kind, spec.entrypoint, *spec.args
        )
        return 0, ""
    except ChildFailedError as err:
        failures = [
            RankFailure(
                rank, f.local_rank, f.pid, f.exitcode, f.error_file_data or {}, state.rank_dirs.get(rank)
            )
            for rank, f in err.failures.items()
        ]
        status = first_failure(failures).exit_status
        code = status if status > 0 else 128 - status
        hang = read_hang_report(state.attempt_dir())
        if hang is not None:
            return code, format_hang_failure(hang, failures, state.world_size)
        return code, format_failure(failures, state.world_size)
    except (SignalException, KeyboardInterrupt) as exc:
        sig = getattr(exc, "sigval", signal.SIGINT)
        return 128 + int(sig), (
            f"lockstep run: interrupted by {signal.Signals(sig).name}; "
            "every worker's process group was stopped"
        )
    except RendezvousError as exc:
        raise LaunchError(
            f"rendezvous at {spec.endpoint} failed ({type(exc).__name__}: {exc}); check that every node "
            "uses the same --rdzv-endpoint and --rdzv-id, that the head node is reachable on that port, "
            "and set --local-addr / --network-interface to this node's address on the shared network"
        ) from exc
