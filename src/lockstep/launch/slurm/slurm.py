"""`lockstep slurm`: write an sbatch script that runs one `lockstep run` per node, save it, submit it.

    lockstep slurm --nodes 2 -n 4 --gpus-per-node 4 --time 2:00:00 --requeue train.py --lr 3e-4

The script (saved as `<run_dir>/sbatch.sh`, printed by `--dry-run`) starts one `lockstep run` per node
under `srun --ntasks-per-node=1`. Every node finds the same head node (the first host of
SLURM_JOB_NODELIST, by `scontrol show hostnames`) and the same port (derived from the job id, as
`lockstep.runtime.env.slurm_notation.slurm_port`), and passes `--nnodes $SLURM_NNODES --node-rank $SLURM_NODEID
--rdzv-endpoint HEAD:PORT --rdzv-id $SLURM_JOB_ID`: node 0 hosts torch's c10d rendezvous store.

With `--requeue`, SLURM sends SIGUSR1 to the batch shell `--signal-before` seconds before the time limit
(`#SBATCH --signal=B:USR1@SECS`). The trap forwards it to every process of the job step (srun does that),
so a training script that handles SIGUSR1 saves a checkpoint and exits; then the script runs `scontrol
requeue $SLURM_JOB_ID` and the requeued job (same id, SLURM_RESTART_COUNT > 0) resumes from the
checkpoint. If the step is still running 10 s before the limit, the job is requeued anyway (it resumes
from its latest periodic checkpoint). The `lockstep run` launchers are started with SIGUSR1 ignored
(`trap '' USR1`), which they keep: srun already delivers it to every process of the step, workers included,
and a launcher that also passed it on (what `lockstep run` does with a SIGUSR1 it does not ignore) would
deliver it twice.

`render_script(spec)` (launch/slurm/slurm_script.py) is pure, unit-tested line by line; `main(argv)` parses,
writes, and submits with `sbatch --parsable`, then prints the job id and where the logs go.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import NoReturn

from lockstep.errors import ConfigError, LaunchError
from lockstep.launch.slurm.slurm_script import render_script
from lockstep.launch.slurm.slurm_spec import DEFAULT_SIGNAL_BEFORE, SlurmSpec


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def build_parser(prog: str = "lockstep slurm") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        allow_abbrev=False,
        usage="%(prog)s [options] SCRIPT [script args...]",
        description="Write an sbatch script that runs `lockstep run` on every node of a SLURM job, "
        "save it in the run directory and submit it with sbatch.",
    )
    add = parser.add_argument
    add("--nodes", "-N", type=int, default=1, help="number of nodes (default 1)")
    add(
        "-n",
        "--nproc-per-node",
        dest="nproc_per_node",
        type=int,
        default=None,
        help="processes per node (default: --gpus-per-node, else 1)",
    )
    add("--gpus-per-node", type=int, default=None, help="GPUs per node (one process per GPU)")
    add(
        "--cpus-per-task", type=int, default=None, help="CPUs per node for its launcher and all its processes"
    )
    add("--partition", "-p", default=None)
    add("--time", "-t", default=None, help="time limit, e.g. 2:00:00 or 1-00:00:00")
    add("--account", "-A", default=None)
    add("--job-name", "-J", default=None, help="default: the script's name")
    add(
        "--requeue",
        action="store_true",
        help="SIGUSR1 --signal-before seconds before the time limit: the job checkpoints and requeues itself",
    )
    add(
        "--signal-before",
        type=int,
        default=DEFAULT_SIGNAL_BEFORE,
        metavar="SECONDS",
        help=f"with --requeue: when to signal before the limit (default {DEFAULT_SIGNAL_BEFORE})",
    )
    add("--network-interface", default=None, metavar="IFNAME", help="passed to `lockstep run` on every node")
    add("--max-restarts", type=int, default=0, help="passed to `lockstep run` on every node")
    add(
        "--run-dir", default=None, help="where the script and logs go (default ./runs/slurm-<timestamp>-<id>)"
    )
    add("--dry-run", action="store_true", help="print the script (and still save it); do not submit")
    add("script", nargs="?", default=None)
    add("script_args", nargs=argparse.REMAINDER)
    return parser


def parse_args(argv: Sequence[str], *, cwd: str, python: str = sys.executable) -> tuple[SlurmSpec, bool]:
    """argv (without 'slurm') -> (SlurmSpec, dry_run)."""
    ns = build_parser().parse_args(list(argv))
    if ns.script is None:
        raise ConfigError(
            "no script given; name the training script, e.g. `lockstep slurm --nodes 2 train.py`"
        )
    if not os.path.exists(os.path.join(cwd, ns.script)):
        raise ConfigError(
            f"script {ns.script!r} not found (looked in {cwd!r}); the job runs it from this directory"
        )
    name = f"slurm-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = os.path.abspath(os.path.join(cwd, ns.run_dir or os.path.join("runs", name)))
    nproc = ns.nproc_per_node if ns.nproc_per_node is not None else (ns.gpus_per_node or 1)
    spec = SlurmSpec(
        script=ns.script,
        args=tuple(ns.script_args),
        run_dir=run_dir,
        workdir=os.path.abspath(cwd),
        python=python,
        nodes=ns.nodes,
        nproc_per_node=nproc,
        gpus_per_node=ns.gpus_per_node,
        cpus_per_task=ns.cpus_per_task,
        partition=ns.partition,
        time=ns.time,
        account=ns.account,
        job_name=ns.job_name,
        requeue=ns.requeue,
        signal_before=ns.signal_before,
        network_interface=ns.network_interface,
        max_restarts=ns.max_restarts,
    )
    return spec, ns.dry_run


def write_script(spec: SlurmSpec) -> str:
    try:
        os.makedirs(spec.run_dir, exist_ok=True)
        with open(spec.script_path, "w") as fh:
            fh.write(render_script(spec))
        os.chmod(spec.script_path, 0o755)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {spec.script_path!r} ({exc.strerror}); pick a writable --run-dir"
        ) from None
    return spec.script_path


def submit(spec: SlurmSpec) -> int:
    """`sbatch --parsable <script>` -> job id; LaunchError with sbatch's message when it refuses."""
    try:
        result = subprocess.run(
            ["sbatch", "--parsable", spec.script_path],
            capture_output=True,
            text=True,
            cwd=spec.workdir,
            timeout=60,
        )
    except FileNotFoundError:
        raise LaunchError(
            "sbatch was not found on PATH; run `lockstep slurm` on a SLURM login node, "
            f"or submit {spec.script_path} yourself"
        ) from None
    except subprocess.TimeoutExpired:
        raise LaunchError(
            f"sbatch did not answer in 60 s; is slurmctld up? (`sinfo`); the script is {spec.script_path}"
        ) from None
    job = result.stdout.strip().split(";")[0]
    if result.returncode != 0 or not job.isdigit():
        raise LaunchError(
            f"sbatch refused the job (exit {result.returncode}): {result.stderr.strip() or result.stdout.strip()}; "
            f"the script is {spec.script_path}"
        )
    return int(job)


def main(argv: list[str]) -> int:
    """`lockstep slurm ...`: write the script, print it (--dry-run) or submit it; print job id and logs."""
    spec, dry_run = parse_args(argv, cwd=os.getcwd())
    path = write_script(spec)
    if dry_run:
        sys.stdout.write(render_script(spec))
        sys.stderr.write(
            f"lockstep slurm: dry run; script saved as {path} (submit it with `sbatch {path}`)\n"
        )
        return 0
    job = submit(spec)
    sys.stdout.write(
        f"lockstep slurm: submitted job {job} ({spec.nodes} node{'s' if spec.nodes != 1 else ''} x "
        f"{spec.nproc_per_node} process{'es' if spec.nproc_per_node != 1 else ''})\n"
        f"  script:    {path}\n"
        f"  output:    {spec.output_pattern.replace('%j', str(job))}\n"
        f"  rank logs: {spec.run_dir}/logs/{job}.<restart>/rank<R>/{{stdout,stderr}}.log\n"
        f"  watch:     squeue -j {job}; tail -f {spec.output_pattern.replace('%j', str(job))}\n"
    )
    return 0


def _module_main() -> int:
    """`python -m lockstep.launch.slurm.slurm ...`: the same as `lockstep slurm ...` (errors exit 2 / 1)."""
    try:
        return main(sys.argv[1:])
    except ConfigError as exc:
        sys.stderr.write(f"lockstep slurm: error: {exc}\n")
        return 2
    except LaunchError as exc:
        sys.stderr.write(f"lockstep slurm: error: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(_module_main())
