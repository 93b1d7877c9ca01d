"""torch's Joinable protocol for both faces of the engine (the drop-in class and the handle), on the replica.

torch's Join manager reads a Joinable's `join_hook()`, `join_device`, `join_process_group` and
`_join_config`; both faces forward them to their ReplicaState (state.py), which does the work through
join.py. `model.join()` here or torch's `Join([model, ...])` (with ZeroRedundancyOptimizer, say) both work.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook

from lockstep.engine.buckets.join import EngineJoin
from lockstep.engine.replica.state import ReplicaState
from lockstep.torch_private import JoinConfig


class JoinableReplica(Joinable):
    """torch's Joinable protocol for both faces of the engine, forwarded to the replica's state.

    `join()` here or torch's `Join([model, ...])` (with ZeroRedundancyOptimizer, say) both work.
    """

    @property
    @abstractmethod
    def _engine(self) -> ReplicaState:
        """The replica's engine state (each face keeps it its own way)."""

    def __init__(self) -> None:  # Joinable's __init__ would set _join_config before the replica exists
        pass

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> EngineJoin:
        """Train on uneven inputs: `with model.join(): for batch in my_batches: ...` (torch's contract).

        Ranks that run out of batches shadow the collectives of those still training until all are
        done; then the replicas are made identical (the last rank to join broadcasts its parameters).
        divide_by_initial_world_size: average over the initial world size (True) or over the ranks still
        training (False). throw_on_early_termination: raise UnevenInputsError on every rank as soon as
        one runs out (needed when forward has collectives of its own, such as SyncBatchNorm).
        """
        return EngineJoin(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self._engine.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self._engine.join_device

    @property
    def join_process_group(self) -> Any:
        return self._engine.join_process_group

    @property
    def _join_config(self) -> JoinConfig:  # torch's Joinable attribute, read and set by its Join manager
        return self._engine.join_config

    @_join_config.setter
    def _join_config(self, config: JoinConfig) -> None:
        self._engine.join_config = config
