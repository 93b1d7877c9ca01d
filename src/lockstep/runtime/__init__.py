"""Who am I and how do I talk to the others: topology, process group, small collectives, rank-aware logs.

The launcher imports this package: nothing here imports the engine.

Modules:
- collectives.py: Small typed collectives that every layer needs: rank queries, barrier, scalar means, JSON
  objects.
- hang_report.py: After a hang verdict: every rank's final state joined into one report, written once and
  printed everywhere.
- live_host.py: The process around a live group: runtime's side of membership/host.py's `Host`.
- logging.py: Rank-aware logging: INFO from global rank 0 only; warnings and errors from every rank, prefixed
  [rank r/w].
- memory.py: Memory as a number for every run: the model state this rank holds (local bytes, each storage
  once) and the process's peak.
- micro_batches.py: Which rank computes which micro-batch of a step, and the random seed of each: pure, world-
  size aware.
- peer_heartbeats.py: The other ranks' heartbeats as the hang watchdog reads them: each rank's latest state,
  and whether it lives.
- phase_clock.py: Time per phase per step on the main thread, kept in a fixed ring, summarised for the
  straggler reports.
- process_group.py: Own the default process group's lifetime: form it from a Topology, leave it, explain
  failures.
- process_inspection.py: Look at a process without asking it: Python stacks of this one, and whether a peer on
  this host still runs.
- progress.py: Always-on progress tracking: what this process is doing now (step, phase, the collective it
  waits in).
- run_account.py: The run's account of its time: goodput, and the time lost by cause.
- sigterm_guard.py: Hold the launcher's SIGTERM back while this rank waits in a collective, so a failure's
  report gets out.
- stall_verdict.py: Judge a stall from every rank's published state, and write the one report a user reads.
- state_transfer.py: Send a training state (nested state dicts) from one rank to the others over the process
  group.
- straggler_eviction.py: Dropping a straggler in live mode (`lockstep run --min-world M --evict-stragglers
  FACTOR`).
- straggler_reports.py: Straggler reports: name a rank that is persistently slower than the others, by how
  much and in which phase.
- waits.py: How the main thread waits on lockstep's collectives: tracked for the hang watchdog, given up on a
  lost member.
- watchdog.py: The hang watchdog: a thread per process that publishes this rank's progress and names a stall.
- env/: Where this process stands, from its environment alone: the variables launcher and runtime share,
  SLURM's notations, and the `Topology` they make (pure: no process group, no torch.distributed).
- membership/: Live membership: the group's generations over one c10d store, so that training survives a lost
  rank.
- timeline/: A per-rank timeline of a run: each process's phases, collective waits, steps and marked events,
  written as a part per process and merged into one Chrome trace (Perfetto, chrome://tracing).
"""

from __future__ import annotations

from lockstep.runtime.collectives import (
    all_gather_object,
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    is_main,
    main_process_first,
)
from lockstep.runtime.env.slurm_notation import expand_hostlist
from lockstep.runtime.env.topology import Topology, resolve_topology
from lockstep.runtime.logging import get_logger
from lockstep.runtime.process_group import JoinedTopology, init, is_initialized, shutdown
from lockstep.runtime.progress import phase
from lockstep.runtime.run_account import goodput
from lockstep.runtime.straggler_reports import StragglerReport, stragglers

__all__ = [
    "JoinedTopology",
    "StragglerReport",
    "Topology",
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "expand_hostlist",
    "get_logger",
    "get_rank",
    "get_world_size",
    "goodput",
    "init",
    "is_initialized",
    "is_main",
    "main_process_first",
    "phase",
    "resolve_topology",
    "shutdown",
    "stragglers",
]
