"""Uneven inputs: `join()`, in which ranks that ran out of batches shadow the collectives of the others.

torch's contract (torch.distributed.algorithms.join): inside `with model.join():` a rank whose loop has
ended keeps answering the collectives of the ranks still training, step after step, so that nothing
hangs; once every rank is done, the model of the last rank to join is broadcast, so that the replicas
end identical. The protocol: the same collectives in the same order on every rank.

- Every forward inside join() starts with one all-reduce of a step record (`_exchange`): one slot per
  rank, 1 while that rank still trains, and three flags that only training ranks set: this backward is
  synced, the buckets are rebuilt now, the buffers are broadcast now. A rank that ran out adds zeros
  from the loop in `EngineJoin.__exit__`, so the record tells every rank who still trains.
- Then the training ranks do their usual work: bucket rebuild (rank 0's order), buffer broadcast (from
  the highest training rank, like torch: rank 0 may have joined with stale buffers) and the backward
  (one reduction per bucket, then the unused-parameter agreement). A joined rank mirrors each of them
  with zeros (`_shadow_step`, `Reducer.shadow_backward`), which leaves the sums unchanged. The built-in
  averaging divides by the initial world size (divide_by_initial_world_size=True, torch's default) or
  by the number of ranks still training.
- A record without a training rank ends the loop on every rank; then the highest rank among those that
  joined last broadcasts its parameters and buffers (`_sync_final_model`, torch's rule).

throw_on_early_termination=True: the first record that lacks a rank makes every rank raise
UnevenInputsError naming the rank(s) and the step, before the forward, whose own collectives
(SyncBatchNorm, the user's) no joined rank could shadow.

Outside join() none of this runs: the engine checks one flag per forward. Under torch's own
`Join([model, zero_optimizer])` the same hooks run, and the model also sends torch's notification
all-reduce before its record, as torch's manager expects.

join.py sees a replica only through `JoinReplica` and its reducer only through `JoinReducer` (below):
ReplicaState and Reducer implement them, and mypy checks that they do where state.py hands itself over.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from lockstep.errors import InternalError, UnevenInputsError
from lockstep.runtime.waits import tracked, wait_watching_membership
from lockstep.torch_private import JoinConfig

_SYNC, _REBUILD, _BUFFERS = range(3)  # flags after the per-rank slots of a step record


@dataclass(frozen=True)
class StepRecord:
    """What every rank learns at the start of a step inside join()."""

    training: tuple[int, ...]  # ranks (in the group) that still have a batch for this step
    sync: bool  # their backward is synced (not no_sync, not eval)
    rebuild: bool  # they rebuild the buckets now
    buffers: bool  # they broadcast buffers now


class JoinSession:
    """One replica's state while a join() context is open."""

    def __init__(self, divide_by_initial_world_size: bool) -> None:
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.record_is_notification = False  # EngineJoin's lead: no separate torch notification
        self.steps = 0  # forwards this rank ran inside the context
        self.pending: StepRecord | None = None  # the record EngineJoin's loop already exchanged


class JoinReducer(Protocol):
    """What join() needs of a replica's reducer (lockstep.engine.buckets.reducer.Reducer)."""

    def will_rebuild(self) -> bool:
        """The next synced forward rebuilds the buckets."""
        ...

    def maybe_rebuild(self, *, force: bool = False) -> None:
        """Rebuild the buckets from rank 0's order now (force: a joined rank follows the others)."""
        ...

    def set_divisor(self, num_ranks: int) -> None:
        """Average the next backwards over `num_ranks`."""
        ...

    def shadow_backward(self) -> None:
        """The collectives of a synced backward, with zeros (raises what the training ranks raise)."""
        ...


class JoinReplica(Protocol):
    """What join() needs of a replica (lockstep.engine.replica.state.ReplicaState); join.py reads nothing else.

    The replica is also handed to torch's Join.notify_join_context, which reads torch's Joinable
    attributes (join_device, join_process_group, _join_config) by itself.
    """

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def tag(self) -> str:
        """The `[rank r/w] ` prefix of messages."""
        ...

    @property
    def group(self) -> dist.ProcessGroup | None: ...

    @property
    def join_device(self) -> torch.device: ...

    @property
    def join_config(self) -> JoinConfig:
        """Set by torch's Join: enable, throw_on_early_termination."""
        ...

    @property
    def join_session(self) -> JoinSession | None: ...

    @property
    def reducer(self) -> JoinReducer: ...

    def will_broadcast_buffers(self) -> bool:
        """The next forward broadcasts buffers."""
        ...

    def broadcast_buffers_from(self, group_rank: int) -> None:
        """Every rank takes the buffers of `group_rank` (a rank in the replica's group)."""
        ...

    def broadcast_model_from(self, group_rank: int) -> None:
        """Every rank takes the parameters (and, when the policy says so, buffers) of `group_rank`."""
        ...

    def request_forward_param_sync(self) -> None:
        """Broadcast buffers before the next forward."""
        ...

    def leave_join(self) -> None:
        """The context closed: back to the path without step records."""
        ...


def _exchange(
    replica: JoinReplica, *, training: bool, sync: bool = False, rebuild: bool = False, buffers: bool = False
) -> StepRecord:
    world = replica.world
    values = [0] * (world + 3)
    if training:
        values[replica.rank] = 1
        values[world + _SYNC], values[world + _REBUILD], values[world + _BUFFERS] = sync, rebuild, buffers
    record = torch.tensor(values, dtype=torch.int64, device=replica.join_device)
    with tracked("allreduce (join record)", (record,), replica.group):
        wait_watching_membership(dist.all_reduce(record, group=replica.group, async_op=True))
    summed = record.tolist()
    flags = summed[world:]
    return StepRecord(
        training=tuple(r for r in range(world) if summed[r]),
        sync=flags[_SYNC] > 0,
        rebuild=flags[_REBUILD] > 0,
        buffers=flags[_BUFFERS] > 0,
    )


def _names(ranks: list[int] | tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _early_termination_message(replica: JoinReplica, record: StepRecord, steps_done: int) -> str:
    joined = [r for r in range(replica.world) if r not in record.training]
    return (
        f"{replica.tag}uneven inputs: {_names(joined)} ran out of batches after "
        f"{steps_done} steps inside join(), while {_names(record.training)} went on to step {steps_done + 1}. "
        "join(throw_on_early_termination=True) makes every rank raise here instead of shadowing the ranks "
        "that ran out (needed when forward has its own collectives, such as SyncBatchNorm). Catch this "
        "error on every rank to end the epoch there, give every rank the same number of batches "
        "(lockstep.data.DistributedSampler with drop_last=True), or use throw_on_early_termination=False"
    )


# ---------------------------------------------------------------- a training rank's side


def join_pre_forward(replica: JoinReplica, syncing: bool) -> None:
    """pre_forward inside join(): the step record, then the usual rebuild and buffer broadcast."""
    session = replica.join_session
    if session is None:  # join_hook() makes it when the context is built
        raise InternalError(
            f"{replica.tag}lockstep bug: a forward inside join() found no join session (join_hook() makes "
            "one when the context is built); please report it"
        )
    rebuild = syncing and replica.reducer.will_rebuild()
    buffers = replica.will_broadcast_buffers()
    # Under torch's Join its manager counts ranks with an all-reduce of its own (the replica quacks as a Joinable).
    work = None if session.record_is_notification else Join.notify_join_context(replica)  # type: ignore[arg-type]
    record = _exchange(replica, training=True, sync=syncing, rebuild=rebuild, buffers=buffers)
    if work is not None:
        work.wait()  # issued before the record, so already done
    if replica.join_config.throw_on_early_termination and len(record.training) < replica.world:
        raise UnevenInputsError(_early_termination_message(replica, record, session.steps))
    session.steps += 1
    if syncing:
        divisor = replica.world if session.divide_by_initial_world_size else len(record.training)
        replica.reducer.set_divisor(divisor)
    if rebuild:
        replica.reducer.maybe_rebuild()
    if buffers:
        replica.broadcast_buffers_from(max(record.training))


# ---------------------------------------------------------------- a joined rank's side


def _shadow_step(replica: JoinReplica, record: StepRecord) -> None:
    """Mirror, with zeros, what the training ranks do in the step this record announced."""
    if record.rebuild:
        replica.reducer.maybe_rebuild(force=True)
    if record.buffers:
        replica.broadcast_buffers_from(max(record.training))
    if record.sync:
        replica.reducer.shadow_backward()


def _sync_final_model(replica: JoinReplica, is_last_joiner: bool) -> None:
    """Everyone joined: the highest rank among the last to join broadcasts parameters (and buffers)."""
    replica.request_forward_param_sync()  # the same on every rank, whatever each saw last
    if replica.world == 1:
        return
    candidate = torch.tensor(
        [replica.rank if is_last_joiner else -1], dtype=torch.int64, device=replica.join_device
    )
    with tracked("allreduce max (join: last joiner)", (candidate,), replica.group):
        wait_watching_membership(
            dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=replica.group, async_op=True)
        )
    replica.broadcast_model_from(int(candidate.item()))


class EngineJoinHook(JoinHook):
    """torch's JoinHook for a lockstep replica: shadow each step (main_hook), then sync (post_hook)."""

    def __init__(self, replica: JoinReplica, session: JoinSession) -> None:
        self.replica, self.session = replica, session

    def main_hook(self) -> None:
        record = self.session.pending or _exchange(self.replica, training=False)
        self.session.pending = None
        _shadow_step(self.replica, record)

    def post_hook(self, is_last_joiner: bool) -> None:
        _sync_final_model(self.replica, is_last_joiner)


class EngineJoin(Join):
    """torch's Join context manager, led by a lockstep model (`model.join()`).

    The lead model's step record doubles as the "still training" count (one all-reduce per step, not
    torch's two or three), carries who ran out for the early-termination error, and the context
    switches join mode off on exit, so that later forwards cost nothing.
    """

    def __init__(
        self,
        joinables: list[Any],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(joinables, enable, throw_on_early_termination, **kwargs)
        lead = self._join_hooks[0]
        if not isinstance(lead, EngineJoinHook):
            raise InternalError(
                f"lockstep bug: EngineJoin must be led by a lockstep model's EngineJoinHook, got a "
                f"{type(lead).__name__} from {type(joinables[0]).__name__} (model.join() builds it so; did a "
                "subclass override join_hook()?); please report it"
            )
        self._lead = lead
        lead.session.record_is_notification = True

    def __enter__(self) -> EngineJoin:
        return self

    def __exit__(
        self, type: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            if self._enable and type is None:
                self._shadow_until_all_joined()
        finally:
            self._close()

    def _shadow_until_all_joined(self) -> None:
        replica, session = self._lead.replica, self._lead.session
        is_last_joiner = True
        while True:
            record = _exchange(replica, training=False)
            if not record.training:
                break
            if self._throw_on_early_termination:
                raise UnevenInputsError(_early_termination_message(replica, record, session.steps))
            session.pending = record
            for hook in self._join_hooks:
                hook.main_hook()
            is_last_joiner = False
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)

    def _close(self) -> None:
        for joinable in self._joinables:
            joinable._join_config = JoinConfig.construct_disabled_join_config()
        for hook in self._join_hooks:
            if isinstance(hook, EngineJoinHook):
                hook.replica.leave_join()
