"""Built-in training jobs (`lockstep train JOB`): models, data that ships with the install, and their configs.

A command, not a Python API: nothing is exported. jobs sits above the trainer (tests/unit/test_layers.py).

Modules:
- catalog.py: The built-in jobs of `lockstep train`: each is a config dataclass (configs.py) plus a function
  that builds the run.
- cli.py: `lockstep train JOB -n N --run-dir DIR [--config FILE] [--key value ...]`: a built-in job, launched
  like `lockstep run`.
- configs.py: The built-in jobs' settings: one FitConfig subclass per job of `lockstep train`.
- datasets.py: The built-in jobs' data, all available without a download at run time.
- models.py: The built-in jobs' models: the tutorials' ToyModel and SimpleNet, a digit MLP, a small ResNet, a
  tiny GPT.
- worker.py: What each worker process of `lockstep train` runs: `python -m lockstep.jobs.worker JOB
  CONFIG_JSON`.
"""

from __future__ import annotations

__all__: list[str] = []
