"""Built-in training jobs (`lockstep train JOB`): models, data that ships with the install, and their configs.

A command, not a Python API: nothing is exported. catalog (each job's config dataclass and builder),
models, datasets, cli (`lockstep train`: resolve the config, launch the workers) and worker (what each
worker runs: build the job, then `lockstep.fit`). jobs sits above the trainer (tests/unit/test_layers.py).
"""

from __future__ import annotations

__all__: list[str] = []
