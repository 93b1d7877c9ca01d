"""`lockstep slurm`: an sbatch script that runs one `lockstep run` per node, written, saved and submitted.

Modules:
- slurm.py: `lockstep slurm`: write an sbatch script that runs one `lockstep run` per node, save it, submit
  it.
- slurm_script.py: The text of the sbatch script `lockstep slurm` submits: #SBATCH lines, one `lockstep run`
  per node, requeue.
- slurm_spec.py: What one `lockstep slurm` submission asks for (`SlurmSpec`), checked when it is made.
"""
