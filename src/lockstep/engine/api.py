"""Where models pickled before the engine's faces had modules of their own find the drop-in class.

`torch.save(model)` of a `lockstep.DistributedDataParallel` records its class by module and name; until
the split by face (ddp.py, replicate.py), that was `lockstep.engine.api.DistributedDataParallel`.
Nothing in lockstep imports this module: it keeps such files loadable. New code imports
`lockstep.DistributedDataParallel`.
"""

from __future__ import annotations

from lockstep.engine.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
