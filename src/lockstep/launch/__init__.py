"""The launcher: `lockstep run` (local and multi-node, on torch's elastic agent) and `lockstep env`.

Nothing is imported here on purpose: `lockstep.launch.spec` is pure parsing, `lockstep.launch.local`
starts workers (`launch(spec) -> exit code`), `lockstep.launch.worker` is the in-worker bootstrap and
`lockstep.launch.envinfo` reports the environment. None of them imports the engine.
"""

from __future__ import annotations
