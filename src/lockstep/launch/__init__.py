"""The launcher: `lockstep run` (local and multi-node, on torch's elastic agent), `lockstep slurm`, `lockstep env`.

Nothing is imported here on purpose, so that `lockstep run` loads only what it uses; none of the
modules imports the engine (tests/unit/test_layers.py).

Modules:
- agent_config.py: What torch's elastic agent and the workers are given: run directory, threads, rendezvous,
  LaunchConfig, env.
- console_lines.py: The launcher's own console lines: the header of a run, the line of each restart, the
  multi-node wait.
- console_relay.py: Copy what the workers write to the launcher's console: rank 0 live, the other ranks'
  warnings and errors.
- envinfo.py: `lockstep env`: what a user pastes into a bug report (versions, backends, devices, threads,
  topology).
- failure_report.py: The one block a failed launch ends with: the first failing rank, how it ended, its
  traceback and log tail.
- flag_values.py: Parse the values of `lockstep run`'s flags: HOST:PORT, N or MIN:MAX, KEY=VALUE lists,
  numbers.
- live_account.py: Live mode's account of how each worker ended, and the launcher's last word on the job from
  it.
- live_launch.py: `lockstep run -n N --min-world M`: live mode, where a rank's death does not stop the others.
- live_supervisor.py: Live mode's supervisor: the launcher's loop that watches its workers and tells the store
  what it sees.
- live_workers.py: Live mode's worker processes: started by the launcher itself, signalled, stopped, and read
  after they end.
- local.py: Start one node's workers with torch's elastic agent and supervise them: `launch(spec) -> exit
  code`.
- netif.py: Which network interface holds an address: so that `--local-addr` alone is enough for gloo and
  nccl.
- node_heartbeat.py: Live mode on several nodes: each node's launcher beats on the job's store and marks how
  its workers stand.
- process_sweep.py: Find this launch's worker processes by the pids they wrote, and kill whatever of them is
  left.
- rank_logs.py: Where each worker's output goes: `<run_dir>/rank<R>/{stdout.log,stderr.log,error.json}`, by
  global rank.
- rendezvous.py: One attempt number per rendezvous round, the same on every node: the workers' store prefix
  after a restart.
- signals.py: The launcher's signals: SIGINT/SIGTERM/... stop the run through torch's agent; SIGUSR1/2 go on
  to the workers.
- spec.py: What `lockstep run` should start and how: the LaunchSpec, its command-line parser and its
  validation.
- worker.py: In-worker bootstrap: run the user's script or module with its argv untouched, and record how it
  failed.
- slurm/: `lockstep slurm`: an sbatch script that runs one `lockstep run` per node, written, saved and
  submitted.
"""

from __future__ import annotations
