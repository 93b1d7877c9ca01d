"""Test harness for real multi-host setups on one machine: network-namespace hosts and a SLURM cluster.

Helper modules only (no conftest): `netns` builds "hosts" in network namespaces on a bridge, `slurm_cluster`
starts a real slurmctld + slurmd + munge cluster in a temporary directory. Both clean up after themselves,
and both say why they cannot run (not root, no namespaces, packages missing: `make testbed` installs them)
so tests can skip with that reason.
"""
