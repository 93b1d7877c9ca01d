"""The Lightning strategy "lockstep": Lightning's DDP strategy with lockstep's DistributedDataParallel.

`Trainer(strategy="lockstep")` is `strategy="ddp"` (same launcher, same options, torch's semantics) with
the model wrapped by lockstep's engine. Registered by lockstep/startup/__init__.py once Lightning's
strategies have been imported; this module imports Lightning, so nothing else imports it.
"""

from __future__ import annotations

import importlib
from typing import Any


def register_strategy(strategies: str) -> None:
    """Register "lockstep" in the registry of `strategies` ("lightning.pytorch.strategies" or
    "pytorch_lightning.strategies"), once."""
    package = importlib.import_module(strategies)
    registry = package.StrategyRegistry
    if "lockstep" in registry:
        return
    registry.register(
        "lockstep",
        _strategy_class(package.DDPStrategy),
        description="DDP strategy on lockstep's engine (lockstep.DistributedDataParallel)",
        start_method="popen",
    )


def _strategy_class(ddp_strategy: type) -> type:
    from lockstep.engine.ddp import DistributedDataParallel

    def _setup_model(self: Any, model: Any) -> DistributedDataParallel:
        # Lightning's own _setup_model with lockstep's class (CPU and CUDA alike: lockstep's engine
        # needs no side stream for its construction)
        return DistributedDataParallel(
            module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs
        )

    return type(
        "LockstepStrategy",
        (ddp_strategy,),
        {
            "__doc__": "Lightning's DDPStrategy with the model wrapped by lockstep.DistributedDataParallel.",
            "__module__": __name__,
            "strategy_name": "lockstep",
            "_setup_model": _setup_model,
        },
    )
