"""The names of the environment variables that the launcher writes and the runtime reads, each defined once.

launch/ (the side that starts workers) may import this module; runtime/ (the side that runs inside them)
reads the same names from here, so a variable cannot be renamed on one side only. Nothing here reads the
environment: runtime/env/topology.py does that, from the mapping it is given.

The restart attempt is the one contract of lockstep's own: under torch's elastic agent, which hosts the
rendezvous store and keeps it across restarts, each worker builds its process group under a store prefix
per attempt (runtime/process_group.py), so that a restarted worker never reads what the previous
attempt's workers left there. `lockstep run` (launch/rank_logs.py) tells every worker the job's attempt,
the same on every node, as ATTEMPT_VAR. Under plain torchrun only RESTART_COUNT_VAR exists; it counts this
node's own restarts, which is the job's attempt on one node but not across nodes once a peer restarted
for a failure of its own (launch/rendezvous.py explains how the launcher agrees on one number).
"""

from __future__ import annotations

# lockstep's own: the job's restart attempt (0, 1, ...), written by `lockstep run` for every worker.
ATTEMPT_VAR = "LOCKSTEP_ATTEMPT"
# lockstep's own: the hang watchdog's timeout in seconds (`lockstep run --hang-timeout`; 0 turns it off),
# and the directory where the reporting rank writes hang_report.json (the attempt's directory of the run).
HANG_TIMEOUT_VAR = "LOCKSTEP_HANG_TIMEOUT"
REPORT_DIR_VAR = "LOCKSTEP_REPORT_DIR"
# torch's elastic agent: this node's restarts so far (the fallback for ATTEMPT_VAR under plain torchrun).
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
# torch's elastic agent: "True" when the agent hosts the store at MASTER_ADDR:MASTER_PORT for the workers.
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
AGENT_STORE_ON = "True"

# torchrun's (and torch's agent's) description of a worker's place in the job.
RANK_VAR = "RANK"
WORLD_SIZE_VAR = "WORLD_SIZE"
LOCAL_RANK_VAR = "LOCAL_RANK"
LOCAL_WORLD_SIZE_VAR = "LOCAL_WORLD_SIZE"
GROUP_RANK_VAR = "GROUP_RANK"
MASTER_ADDR_VAR = "MASTER_ADDR"
MASTER_PORT_VAR = "MASTER_PORT"
GROUP_WORLD_SIZE_VAR = "GROUP_WORLD_SIZE"  # nodes in the job (read by the launcher's header only)
TORCHRUN_VARS = (
    RANK_VAR,
    WORLD_SIZE_VAR,
    LOCAL_RANK_VAR,
    LOCAL_WORLD_SIZE_VAR,
    GROUP_RANK_VAR,
    MASTER_ADDR_VAR,
    MASTER_PORT_VAR,
)

# Which CUDA devices a process sees: the runtime picks its device from it; `lockstep env` reports it.
CUDA_VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"

# lockstep's own, live mode (`lockstep run --min-world M`): the launcher hosts the store at
# MASTER_ADDR:MASTER_PORT and keeps the survivors running when a rank dies; each worker re-forms the group
# over the survivors (runtime/membership/) while at least M remain. The store keys of that protocol are
# named in runtime/membership/keys.py.
LIVE_MIN_WORLD_VAR = "LOCKSTEP_MIN_WORLD"
# Each worker's member id in live mode: 0..N-1 for the first N, N, N+1, ... for replacements, which also
# get RANK/LOCAL_RANK of the rank they replace (its device) and LIVE_JOIN_VAR=1 (they queue for admission).
MEMBER_ID_VAR = "LOCKSTEP_MEMBER_ID"
# lockstep's own, live mode (`--evict-stragglers FACTOR`): rank 0 evicts a rank whose busy time stays at
# least FACTOR times the reference rank's (runtime/straggler_eviction.py), as if it had failed.
EVICT_STRAGGLERS_VAR = "LOCKSTEP_EVICT_STRAGGLERS"
LIVE_JOIN_VAR = "LOCKSTEP_LIVE_JOIN"
