"""What each worker process of `lockstep train` runs: `python -m lockstep.jobs.worker JOB CONFIG_JSON`."""

from __future__ import annotations

import sys

from lockstep.jobs.catalog import build, job
from lockstep.runtime import init, shutdown
from lockstep.trainer.api import fit
from lockstep.trainer.settings.config import Source
from lockstep.trainer.settings.config_sources import config_from_mapping, load_config_file


def run_job(name: str, config_path: str) -> dict:
    config_cls, _ = job(name)
    config = config_from_mapping(config_cls, load_config_file(config_path), Source.file(config_path))
    # Built before joining the group: the same on every rank, and a replacement in live mode builds it
    # before the members admit it, not while they wait for it (its data and model take a second or more)
    built = build(name, config)
    init()
    result = fit(
        built.model, built.train_data, loss_fn=built.loss_fn, config=config, eval_data=built.eval_data
    )
    return result.summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m lockstep.jobs.worker JOB CONFIG_JSON", file=sys.stderr)
        return 2
    try:
        run_job(args[0], args[1])
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
