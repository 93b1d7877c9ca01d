"""The launcher: `lockstep run` (local and multi-node, on torch's elastic agent), `lockstep slurm`, `lockstep env`.

Nothing is imported here on purpose, so that `lockstep run` loads only what it uses: spec (LaunchSpec and
the command-line parser, pure), local (starts and supervises one node's workers: `launch(spec) -> exit
code`), worker (the in-worker bootstrap), slurm (sbatch scripts) and envinfo (`lockstep env`), with their
helpers (logs, output, netif, rendezvous). None of them imports the engine (tests/unit/test_layers.py).
"""

from __future__ import annotations
