"""Where this process stands, from its environment alone: the variables launcher and runtime share, SLURM's
notations, and the `Topology` they make (pure: no process group, no torch.distributed).

Modules:
- env_contract.py: The names of the environment variables that the launcher writes and the runtime reads, each
  defined once.
- slurm_notation.py: SLURM's own notations: compressed host and task lists, and the port that a job's ranks
  meet on.
- topology.py: Pure mapping from an environment (torchrun, SLURM, explicit arguments or nothing) to a
  Topology.
"""
