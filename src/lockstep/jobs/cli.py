"""`lockstep train JOB -n N --run-dir DIR [--config FILE] [--key value ...]`: a built-in job, launched like `lockstep run`.

The launcher process resolves the job's config (dataclass defaults, then the YAML/JSON file, then
`--key value` overrides), checks the run's plan (lockstep/plan.py: a pair of settings that does not
combine is refused here, in one line with exit status 2, before torch is imported or a worker starts),
saves the config in the run directory, and starts N workers that each run
`python -m lockstep.jobs.worker JOB RUN_DIR/config.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lockstep.errors import ConfigError
from lockstep.jobs.configs import CONFIGS
from lockstep.plan import PYTHON_ONLY, SETTINGS, Plan, RunSettings, flag_of, flag_verdicts
from lockstep.trainer.settings.config import FitConfig, Source, config_to_dict
from lockstep.trainer.settings.config_sources import (
    bool_settings,
    config_from_mapping,
    load_config_file,
    read_overrides,
)

EPILOG = """\
jobs:
{jobs}

Any setting of the job's config can be given as --key value (or --key=value), e.g.
  lockstep train digits -n 2 --run-dir runs/digits --epochs 30 --lr 0.002
  lockstep train gpt -n 2 --run-dir runs/gpt --max-steps 100 --precision bf16
  lockstep train digits -n 3 --deterministic --global-batch-size 64 --micro-batch-size 8
  lockstep train digits -n 2 --run-dir runs/digits --overlap-optimizer true
  lockstep train gpt -n 4 --shard-degree 2 --reshard-after-forward false   (HSDP: 2 groups of 2 shards)
  lockstep train mnist -n 2 --run-dir runs/mnist --data /usr/share/datasets/fashion-mnist/
The resolved config is saved as RUN_DIR/config.json (and config.yaml when pyyaml is installed).
A run directory that already holds checkpoints resumes from the newest valid one (--resume never to start over).
Show a job's settings with: lockstep train JOB --show-config

Slow links (--sync local_sgd | diloco | streaming_diloco, each rank steps alone and syncs every
--sync-every H steps): DiLoCo's outer momentum (--outer-momentum, default 0.9) rises from 0 over the
first --outer-momentum-warmup outer steps (default 10), so a short run is not far behind all-reduce
and a long one keeps the paper's 0.9; --sync-warmup N averages gradients for N steps first (default
0). streaming_diloco: --fragments F, --fragment-layout sliced|strided|contiguous (default sliced:
every parameter's rows cut in F equal blocks; strided: layer i in fragment i mod F), --fragment-mix
(default 0.5: a merge keeps half of the local values), --fragment-delay (default 1: a fragment's mean
is in flight for 1 inner step; more hides a slower link).

Which settings do not combine (lockstep/plan.py's table, docs/modes.md):
{verdicts}
"""


def verdicts_help() -> str:
    """Each flag of the run's plan with what the table says of it against the others (the plan's words)."""
    lines = []
    for setting in SETTINGS:
        verdicts = flag_verdicts(setting.key)
        if setting.key not in PYTHON_ONLY and verdicts:
            lines.append(f"  {flag_of(setting.key)}: {verdicts}")
    return "\n".join(lines)


def flag_help(text: str, key: str) -> str:
    """An argument's own help, then what the plan says of it ('' added where every pair runs)."""
    verdicts = flag_verdicts(key)
    return f"{text} ({verdicts})" if verdicts else text


def build_parser() -> argparse.ArgumentParser:
    jobs = "\n".join(f"  {name:<8} {(cls.__doc__ or '').strip()}" for name, cls in CONFIGS.items())
    parser = argparse.ArgumentParser(
        prog="lockstep train",
        description="Train a built-in job data-parallel on N processes, on data that ships with the install.",
        epilog=EPILOG.format(jobs=jobs, verdicts=verdicts_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("job", choices=sorted(CONFIGS), metavar="JOB", help="one of: " + ", ".join(CONFIGS))
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=int,
        default=1,
        help="worker processes on this node (default 1)",
    )
    parser.add_argument(
        "--run-dir", default=None, help="where checkpoints, logs and the summary go (default runs/JOB)"
    )
    parser.add_argument(
        "--config", default=None, help="a YAML or JSON file of settings; --key value overrides it"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="restart all workers up to this many times"
    )
    parser.add_argument(
        "--min-world",
        type=int,
        default=None,
        metavar="M",
        help=flag_help(
            "live mode: when a rank dies the others go on without a restart while at least M remain "
            "(with --deterministic, with the bits of a run without faults); with --max-restarts R, up to R "
            "replacements join",
            "live",
        ),
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end the job with a report naming the stuck rank when a rank waits this long in a collective "
        "(default 300; 0: off)",
    )
    parser.add_argument(
        "--evict-stragglers",
        type=float,
        default=None,
        metavar="FACTOR",
        help="live mode: a rank whose busy time per step stays FACTOR (> 1) times the other ranks' is evicted "
        "as if it had failed, and the others go on (the fault record says why)",
    )
    parser.add_argument(
        "--logs", choices=("rank0", "all"), default="rank0", help="which ranks stream to the console"
    )
    parser.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    return parser


def resolve_config(
    job_name: str, config_file: str | None, overrides: list[str], run_dir: str | None
) -> FitConfig:
    """Defaults, then the file, then --key value overrides; run_dir from --run-dir. Errors name each value's source."""
    if job_name not in CONFIGS:
        raise ConfigError(f"unknown job {job_name!r}; built-in jobs: {', '.join(CONFIGS)}")
    config_cls = CONFIGS[job_name]
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    if config_file:
        from_file = load_config_file(config_file)
        values.update(from_file)
        sources.update(dict.fromkeys(from_file, Source.file(config_file)))
    flag_values, flag_sources = read_overrides(overrides, switches=bool_settings(config_cls))
    values.update(flag_values)
    sources.update(flag_sources)
    if run_dir:
        values["run_dir"], sources["run_dir"] = run_dir, Source.flag("--run-dir")
    values.setdefault("run_dir", f"runs/{job_name}")
    return config_from_mapping(config_cls, values, sources)


def save_config(config: FitConfig, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    values = config_to_dict(config)
    path = run_dir / "config.json"
    path.write_text(json.dumps(values, indent=2) + "\n")
    try:
        import yaml

        (run_dir / "config.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    except ImportError:
        pass
    return path


def plan_of(args: argparse.Namespace, config: FitConfig) -> Plan:
    """The run's plan from its settings and its launch: the verdict of `lockstep train` on them (a refused
    pair: PlanRefused, one line and exit status 2 in cli.py), the same table `fit` asks."""
    settings = RunSettings.of(
        config,
        world_size=args.nproc_per_node,
        live=args.min_world is not None,
        max_restarts=args.max_restarts,
        min_world=args.min_world or 0,
    )
    return Plan.of(settings, flags=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        config = resolve_config(args.job, args.config, rest, args.run_dir)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.show_config:
        print(json.dumps(config_to_dict(config), indent=2))
        return 0
    if args.nproc_per_node < 1:
        parser.error(f"-n {args.nproc_per_node}: need at least 1 process")
    plan = plan_of(args, config)
    for note in plan.notes():
        print(f"lockstep train: note: {note}", file=sys.stderr)
    run_dir = Path(config.run_dir)
    config_path = save_config(config, run_dir)
    from lockstep.launch.local import launch
    from lockstep.launch.spec import LaunchSpec, validate

    spec = LaunchSpec(
        entrypoint="lockstep.jobs.worker",
        module=True,
        args=(args.job, str(config_path)),
        nproc_per_node=args.nproc_per_node,
        max_restarts=args.max_restarts,
        min_world=args.min_world,
        hang_timeout=args.hang_timeout,
        evict_stragglers=args.evict_stragglers,
        run_dir=str(run_dir),
        logs=args.logs,
    )
    try:
        validate(spec)  # the flags shared with `lockstep run` (--min-world against -n, ...)
    except ConfigError as exc:
        parser.error(str(exc))
    code = launch(spec)
    if code != 0:
        _timeline_after_a_failure(run_dir)
    return code


def _timeline_after_a_failure(run_dir: Path) -> None:
    """A job that failed: the timeline up to the failure, from what each rank left in run_dir/trace/."""
    from lockstep.runtime.timeline import merge_trace
    from lockstep.trainer.reporting.timeline_plot import draw_timeline

    try:
        trace = merge_trace(run_dir)
        picture = draw_timeline(run_dir)
    except Exception as exc:  # noqa: BLE001 (the failure is the news; its timeline is a courtesy)
        print(f"lockstep train: no timeline of the failed run ({type(exc).__name__}: {exc})", file=sys.stderr)
        return
    if trace is not None:
        shown = f"{trace}" + (f" and {picture}" if picture else "")
        print(f"lockstep train: the run's timeline up to the failure: {shown}", file=sys.stderr)
