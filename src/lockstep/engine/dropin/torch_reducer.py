"""`model.reducer` of the drop-in class: the calls frameworks make on torch's C++ reducer, on lockstep's engine.

Lightning's manual optimization arms the reducer itself before `manual_backward`
(`reducer._rebuild_buckets(); reducer.prepare_for_backward(outputs)`, lightning/pytorch/overrides/
distributed.py), and flushes a static graph's first step (`reducer._delay_all_reduce()`); Accelerate's
`trigger_sync_in_backward` calls `reducer.prepare_for_backward([])`. Each does here what torch's does:

- `prepare_for_backward(outputs)`: the next backward reduces (the reducer is ARMED), with unused
  parameters found from `outputs` when find_unused_parameters is set (torch's search);
- `_rebuild_buckets()`: the one-time rebuild from the first step's ready order, if it is due (a
  collective, as torch's); returns whether it rebuilt;
- `_delay_all_reduce()`: torch's flush of a static graph's first step. lockstep's reducer flushes that
  step itself at the end of its backward, so a call afterwards (Lightning's) has nothing left to do;
- `_ddp_graph_static()`: False once two forwards left different parameters unused (torch's
  `can_set_static_graph`).

Anything else of torch's reducer raises TorchInternalAttributeError naming it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lockstep.errors import TorchInternalAttributeError, UsageError

if TYPE_CHECKING:
    from lockstep.engine.buckets.reducer import Reducer
    from lockstep.engine.replica.state import ReplicaState


class TorchReducerFace:
    """What `DistributedDataParallel.reducer` returns; holds its wrapper weakly (no reference cycle)."""

    def __init__(self, engine_of: Any) -> None:
        # engine_of: the DDP wrapper; its `_engine` is looked up at each call (rebuilt after unpickling)
        self._wrapper = weakref.ref(engine_of)

    @property
    def _engine(self) -> ReplicaState:
        wrapper = self._wrapper()
        if wrapper is None:
            raise UsageError(
                "the DistributedDataParallel this reducer belonged to no longer exists; keep the wrapped model "
                "while its reducer is used"
            )
        engine: ReplicaState = wrapper._engine
        return engine

    @property
    def _reducer(self) -> Reducer:
        return self._engine.reducer

    def prepare_for_backward(self, outputs: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Arm the reducer for the next backward (torch's contract; a tensor or a list of tensors)."""
        tensors = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        engine = self._engine
        engine.reducer.prepare_for_backward(tensors, engine.t_forward)

    def _rebuild_buckets(self) -> bool:
        """Rebuild the buckets now if the first synced step's order is waiting; True if it rebuilt."""
        reducer = self._reducer
        if not reducer.will_rebuild():
            return False
        reducer.maybe_rebuild()
        return True

    def _delay_all_reduce(self) -> None:
        """Nothing left to do: the static graph's first step was reduced at the end of its backward."""

    def _ddp_graph_static(self) -> bool:
        return self._reducer.graph_static

    def __getattr__(self, name: str) -> Any:
        raise TorchInternalAttributeError(
            f"lockstep.DistributedDataParallel's reducer has no {name!r}: it is an internal of torch's C++ "
            "reducer, which lockstep's engine replaces; it answers prepare_for_backward, _rebuild_buckets, "
            "_delay_all_reduce and _ddp_graph_static (docs/frameworks.md). Use torch's class "
            "(lockstep run --ddp torch) for a program that needs more"
        )
