"""Live mode for a training loop of your own: `lockstep.LiveLoop`.

`lockstep.fit` handles live mode by itself (trainer/live_fit.py). A program with its own loop hands
LiveLoop the three things a step depends on, and LiveLoop runs the steps:

- the model (LiveLoop replicates it; with deterministic=True, the default, in deterministic mode: the
  same bits at any world size, so a step redone over fewer ranks gives what the full group would have;
  with deterministic=False the engine sums in float with its buckets, faster, equal up to rounding);
- the optimizer (stepped by LiveLoop once the gradients are averaged);
- a `lockstep.data.MicroBatchSampler`: which samples form each step's micro-batches, from (seed, epoch,
  step) alone, and the position reached, which is all a replacement needs to know of the data.

The program gives the forward and backward of one micro-batch as a function of its sample indices.
When a member is lost in a step (under `lockstep run --min-world M`), LiveLoop re-forms the group over
the survivors, re-cuts the sampler's shard and redoes that step; at a step boundary it admits
replacements, which receive model, optimizer, sampler, step and the `state` objects (a scheduler, say)
from rank 0. Outside live mode (a plain `lockstep run`, torchrun) the same program trains as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lockstep.data.micro_batch_sampler import MicroBatchSampler
from lockstep.engine.api import ReplicaHandle, replicate
from lockstep.engine.policy import SyncPolicy
from lockstep.errors import ConfigError, InternalError, MembershipChanged, rank_tag
from lockstep.runtime import live
from lockstep.runtime.collectives import all_gather_object
from lockstep.runtime.live import Fault, LiveGroup
from lockstep.runtime.state_transfer import broadcast_state

NO_STATE = -1  # the step a replacement reports before it received its state


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class LiveLoop:
    """Your training loop, surviving lost ranks and admitting replacements (live mode).

        sampler = lockstep.data.MicroBatchSampler(dataset, micro_batch_size=8, num_micro_batches=8)
        loop = lockstep.LiveLoop(model, optimizer, sampler, state={"scheduler": scheduler})

        def micro_step(indices):            # forward and backward of one micro-batch
            x, y = inputs[indices], targets[indices]
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss.detach()

        for epoch in range(loop.epoch, epochs):
            for losses in loop.train_epoch(epoch, micro_step):  # after each completed step
                scheduler.step()

    `deterministic=False` trades the same bits at any world size for the default engine's speed (each
    rank then needs a micro-batch of every step: num_micro_batches >= the launched world size).
    `train_epoch` yields this rank's results of the step, by micro-batch ordinal. Work of your own
    between steps that issues collectives (a checkpoint save, an evaluation) goes through
    `loop.retry(work)`, which redoes it over the survivors when a member is lost in it.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: MicroBatchSampler,
        *,
        state: Mapping[str, Stateful] | None = None,
        seed: int = 0,
        deterministic: bool = True,
    ) -> None:
        if not isinstance(sampler, MicroBatchSampler):
            raise ConfigError(
                f"LiveLoop needs a lockstep.data.MicroBatchSampler (each step's micro-batches fixed at any "
                f"world size), got {type(sampler).__name__}"
            )
        if not sampler.drop_last:
            raise ConfigError(
                "LiveLoop needs MicroBatchSampler(drop_last=True): every step is a whole global batch"
            )
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.state = dict(state or {})
        self.seed = seed
        self.policy = SyncPolicy(deterministic=deterministic)
        self.step = 0  # optimizer steps completed
        self.faults: list[dict[str, Any]] = []
        self.group: LiveGroup | None = live.current()
        self.handle: ReplicaHandle | None = live.retry_start(lambda: replicate(model, policy=self.policy))
        # Members lost at start-up (before this loop began) are faults of this run too.
        self.faults = (
            [{"step": 0, **asdict(f), "recover_s": round(f.recover_s, 4)} for f in self.group.faults]
            if self.group
            else []
        )
        if self.group is not None and self.group.needs_state:
            self._receive_state()

    @property
    def epoch(self) -> int:
        """The epoch to train next (past a finished one; inside one the sampler's state stopped in)."""
        return int(self.sampler.state_dict()["epoch"])

    # ---- the steps ----------------------------------------------------------------------------------------

    def train_epoch(self, epoch: int, micro_step: Callable[[list[int]], Any]) -> Iterator[dict[int, Any]]:
        """Train `epoch` (from where the sampler stopped, if inside it); yield after each completed step."""
        self.sampler.set_epoch(epoch)
        batches, steps_left = self._cut()
        while steps_left > 0:
            # Replacements join at the top of a step: there they stand where a new process starts, after
            # the program's own work of the step before (its scheduler step, say), whose state they receive.
            if self._admit_joiners():
                batches, steps_left = self._cut()
            num = self.sampler.num_micro_batches
            owned = self._handle().owned_micro_batches(num)
            mine = dict(zip(owned, _take(batches, len(owned))))
            try:
                results = self._handle().accumulate(
                    micro_step, mine, num_micro_batches=num, step=self.step, seed=self.seed
                )
                if self.group is not None:
                    self.group.commit(self.step)  # the step counts on every member or on none
                self.optimizer.step()
            except (RuntimeError, dist.DistError) as exc:
                if not self._recover(exc):
                    raise
                batches, steps_left = self._cut()  # the same step again, cut for the survivors
                continue
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.sampler.advance(self.sampler.step_size)
            steps_left -= 1
            yield results

    def retry(self, work: Callable[[], Any]) -> Any:
        """work() (collectives of your own between steps), done again if a member is lost in it."""
        while True:
            try:
                return work()
            except (RuntimeError, dist.DistError) as exc:
                if not self._recover(exc):
                    raise

    def _handle(self) -> ReplicaHandle:
        if self.handle is None:
            raise InternalError("LiveLoop has no replica (it was released and not made again)")
        return self.handle

    def _cut(self) -> tuple[Iterator[list[int]], int]:
        """This rank's micro-batches for the rest of the epoch, and the steps left in it."""
        return iter(self.sampler), self.sampler.num_steps()

    # ---- state ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a replacement (or a resume) needs to continue at this step boundary."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
            "state": {name: obj.state_dict() for name, obj in self.state.items()},
            "faults": self.faults,
        }

    def load_state_dict(self, tree: Mapping[str, Any]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(tree["model"])
        self.optimizer.load_state_dict(tree["optimizer"])
        self.sampler.load_state_dict(tree["sampler"])
        self.step = int(tree["step"])
        for name, obj in self.state.items():
            obj.load_state_dict(tree["state"][name])
        self.faults = list(tree.get("faults", []))

    # ---- live mode ------------------------------------------------------------------------------------------

    def _recover(self, exc: BaseException) -> bool:
        """A collective failed: re-form over the survivors. False when this is not live mode or nobody
        left (the error is the program's own)."""
        group = self.group
        if group is None:
            return False
        before = group.membership.members
        self._release()
        fault = group.reform(exc)
        if group.membership.members == before and not isinstance(exc, MembershipChanged):
            return False
        self.optimizer.zero_grad(set_to_none=True)  # the abandoned step's partial gradients
        self._rejoin(group, fault)
        return True

    def _admit_joiners(self) -> bool:
        group = self.group
        joiners = group.joiners_due(self.step) if group is not None else []
        if group is None or not joiners:
            return False
        try:
            self._release()
            self._rejoin(group, group.reform(f"replacements {joiners} join after step {self.step}", joiners))
        except (RuntimeError, dist.DistError) as exc:  # a member or the replacement died in the growth
            if not self._recover(exc):
                raise
        return True

    def _receive_state(self) -> None:
        group = self.group
        if group is None:
            raise InternalError("_receive_state outside live mode")
        try:
            self._converge(group)
        except (RuntimeError, dist.DistError) as exc:
            group.give_up(exc)  # no state to go on with: leave, so that the members need not wait for it
        self._reshard(group)

    def _release(self) -> None:
        # Nothing may keep the old group alive (see live_fit._release_replica).
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _rejoin(self, group: LiveGroup, fault: Fault) -> None:
        self.handle = replicate(self.model, policy=self.policy)
        record = {"step": self.step, **asdict(fault), "recover_s": round(fault.recover_s, 4)}
        self.faults.append(record)  # before _converge: a replacement receives the list with this record
        started = time.monotonic()
        self._converge(group)
        record["detail"]["converge_s"] = round(time.monotonic() - started, 4)
        self._reshard(group)

    def _converge(self, group: LiveGroup) -> None:
        """Every member stands at the same step; a replacement receives the state from rank 0."""
        steps = [int(s) for s in all_gather_object(NO_STATE if group.needs_state else self.step)]
        members = {s for s in steps if s != NO_STATE}
        if len(members) > 1:
            m = group.membership
            raise InternalError(
                f"{rank_tag(m.rank, m.world_size)}after a change of members the ranks stand at different "
                f"steps ({min(members)} to {max(members)}): one saw the last step complete, another did not"
            )
        if NO_STATE not in steps:
            return
        tree = broadcast_state(self.state_dict() if group.membership.rank == 0 else None, src=0)
        if group.needs_state:
            self.load_state_dict(tree)
            group.state_received()

    def _reshard(self, group: LiveGroup) -> None:
        state = self.sampler.state_dict()
        self.sampler.num_replicas, self.sampler.rank = group.membership.world_size, group.membership.rank
        self.sampler.load_state_dict(state)


def _take(iterator: Iterator[list[int]], count: int) -> list[list[int]]:
    out = []
    for _ in range(count):
        batch = next(iterator, None)
        if batch is None:
            break
        out.append(batch)
    return out
