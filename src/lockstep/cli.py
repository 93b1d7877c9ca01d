"""The `lockstep` command: a thin dispatcher to its subcommands (run, slurm, env, train, compare).

Each subcommand's module is imported only when it is chosen, so `lockstep run` never imports the
engine or the trainer. User mistakes (ConfigError) print one line naming what to fix and exit 2;
launcher failures (LaunchError) exit 1.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

from lockstep.errors import ConfigError, LaunchError

USAGE = """usage: lockstep <command> [options]

commands:
  run     start N processes of a training script (torchrun's flags: -n, --nnodes, --rdzv-endpoint, ...)
  slurm   write an sbatch script that runs `lockstep run` on every node, and submit it (--dry-run: print it)
  train   run a lockstep training job (e.g. `lockstep train digits -n 2`)
  compare tell whether two checkpoints (or runs: their newest checkpoint) are bitwise equal, and where not
  env     print versions, backends, devices, threads, launcher and topology (paste it into bug reports)

`lockstep <command> --help` describes a command.
"""

# Each command is "module:function", a `main(argv: list[str]) -> int` imported only when chosen.
_COMMANDS: dict[str, str] = {
    "run": "lockstep.cli:_run_main",
    "slurm": "lockstep.launch.slurm.slurm:main",
    "env": "lockstep.launch.envinfo:main",
    "train": "lockstep.jobs.cli:main",
    "compare": "lockstep.checkpoint.compare:main",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `lockstep` console script and of `python -m lockstep`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from lockstep import __version__

        sys.stdout.write(f"lockstep {__version__}\n")
        return 0
    command, rest = args[0], args[1:]
    if command not in _COMMANDS:
        return _fail("lockstep", f"unknown command {command!r}; expected one of {', '.join(_COMMANDS)}", 2)
    try:
        handler = _resolve(command)
        return int(handler(rest) or 0)
    except ConfigError as exc:
        return _fail(command, str(exc), 2)
    except LaunchError as exc:
        return _fail(command, str(exc), 1)
    except KeyboardInterrupt:  # Ctrl-C before any worker started (e.g. while torch is importing)
        return _fail(command, "interrupted", 130)


def _resolve(command: str) -> Callable[[list[str]], int]:
    module_name, _, attr = _COMMANDS[command].partition(":")
    handler: Callable[[list[str]], int] = getattr(importlib.import_module(module_name), attr)
    return handler


def _run_main(argv: list[str]) -> int:
    from lockstep.launch.local import launch
    from lockstep.launch.spec import parse_run_args

    return launch(parse_run_args(argv))


def _fail(command: str, message: str, code: int) -> int:
    prog = command if command == "lockstep" else f"lockstep {command}"
    sys.stderr.write(f"{prog}: error: {message}\n")
    return code
