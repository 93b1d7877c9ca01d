"""Live mode for a training loop of your own: `lockstep.LiveLoop`.

`lockstep.fit` handles live mode by itself; a program with its own loop hands LiveLoop the three things a
step depends on, and LiveLoop runs the steps, with the same recovery as fit's
(runtime/membership/recovery.py):

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

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, TypeVar, cast

import torch
from torch import nn

from lockstep.checkpoint.stateful import Stateful
from lockstep.data.micro_batch_sampler import MicroBatchSampler
from lockstep.engine import ReplicaHandle, ShardedOptimizer, replicate
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.sharded import is_sharded
from lockstep.errors import ConfigError, InternalError, NotSupportedError
from lockstep.plan import Plan, PlanRefused, RunSettings
from lockstep.runtime.env.topology import Topology
from lockstep.runtime.membership.group import LiveGroup
from lockstep.runtime.membership.records import Fault
from lockstep.runtime.membership.recovery import LiveRecovery, StartUpRecovery
from lockstep.runtime.process_group import live_group
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.run_account import ACCOUNT, restart_attempt
from lockstep.trainer.run.registry import StateRegistry, Use
from lockstep.trainer.run.step_driver import Outcome, StepDriver

T = TypeVar("T")


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
    `train_epoch` yields this rank's results of the step, by micro-batch ordinal; `lockstep.goodput()`
    tells, at the end, how much of the run's time its counted steps took and where the rest went. Work of your own
    between steps that issues collectives (a checkpoint save, an evaluation) goes through
    `loop.retry(work)`, which redoes it over the survivors when a member is lost in it.

    Args:
        model: the model to train; LiveLoop replicates it (in place, like `lockstep.replicate`).
        optimizer: its optimizer, stepped by LiveLoop once the step's gradients are averaged.
        sampler: a `lockstep.data.MicroBatchSampler(drop_last=True)`: each step's micro-batches, from
            (seed, epoch, step) alone.
        state: more objects with state_dict()/load_state_dict() (a scheduler, say) that a replacement
            receives from rank 0.
        seed: seeds each micro-batch's random numbers (dropout) from (seed, step, micro-batch).
        deterministic: the same bits at any world size (exact sums); False: the default engine's float sums.

    Raises:
        ConfigError: the sampler is not a MicroBatchSampler with drop_last=True.
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
        settings = RunSettings(
            live=True,
            live_loop=True,
            deterministic=deterministic,
            shard_optimizer=isinstance(optimizer, ShardedOptimizer),
            # a model cut by FSDP2 (lockstep.shard, fully_shard): the plan's verdict for sharding in live mode
            shard_degree=2 if is_sharded(model) else 1,
            world_size=2 if is_sharded(model) else 1,
        )
        try:
            Plan.of(settings)  # LiveLoop's door: the table's verdict (lockstep/plan.py)
        except PlanRefused as refused:  # what LiveLoop cannot do yet (a sharded optimizer's shares)
            raise NotSupportedError(str(refused)) from None
        if not sampler.drop_last:
            raise ConfigError(
                "LiveLoop needs MicroBatchSampler(drop_last=True): every step is a whole global batch"
            )
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.state = dict(state or {})
        self.seed = seed
        self.policy = SyncPolicy(deterministic=deterministic)
        self.step = 0  # optimizer steps completed
        ACCOUNT.reset()  # the run's time account starts at its first step (lockstep.goodput())
        self.faults: list[dict[str, Any]] = []
        self.registry = self._register()
        group = live_group()
        self.members: Alone | Members = Alone() if group is None else Members(group)  # chosen once
        # through the members' step driver: in live mode a member lost in the start-up is survived
        self.handle: ReplicaHandle | None = self.members.driver.run(
            lambda: replicate(model, policy=self.policy)
        )
        self.members.attach(self)

    @property
    def driver(self) -> StepDriver:
        """Each step, the admissions and retry()'s work run through it."""
        return self.members.driver

    @property
    def epoch(self) -> int:
        """The epoch to train next (past a finished one; inside one the sampler's state stopped in)."""
        return int(self.sampler.state_dict()["epoch"])

    # ---- the steps ----------------------------------------------------------------------------------------

    def train_epoch(self, epoch: int, micro_step: Callable[[list[int]], Any]) -> Iterator[dict[int, Any]]:
        """Train `epoch` (from where the sampler stopped, if inside it); yield after each completed step."""
        self.sampler.set_epoch(epoch)
        batches, steps_left = self._cut()
        try:
            yield from self._steps(micro_step, batches, steps_left)
        finally:
            PROGRESS.loop_done()  # synced forwards count as steps again once the loop stops

    def _steps(
        self, micro_step: Callable[[list[int]], Any], batches: Iterator[list[int]], steps_left: int
    ) -> Iterator[dict[int, Any]]:
        while steps_left > 0:
            # Replacements join at the top of a step: there they stand where a new process starts, after
            # the program's own work of the step before (its scheduler step, say), whose state they receive.
            if self.driver.changed_by(partial(self.members.admit_joiners, self.step)):
                batches, steps_left = self._cut()
            PROGRESS.loop_step(self.step + 1)  # the timeline's and the account's steps are the loop's
            num = self.sampler.num_micro_batches
            owned = self._handle().owned_micro_batches(num)
            mine = dict(zip(owned, _take(batches, len(owned))))
            outcome, results = self.driver.attempt(partial(self._step, micro_step, mine))
            if outcome is not Outcome.DONE:  # REDO (LiveLoop keeps no round marks to go back to)
                batches, steps_left = self._cut()  # the same step again, cut for the survivors
                continue
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            ACCOUNT.step_ended()
            self.sampler.advance(self.sampler.step_size)
            steps_left -= 1
            yield cast(dict[int, Any], results)

    def _step(self, micro_step: Callable[[list[int]], Any], mine: dict[int, list[int]]) -> dict[int, Any]:
        """One step's collectives: this rank's micro-batches through accumulate(), the commit, the optimizer."""
        results = self._handle().accumulate(
            micro_step, mine, num_micro_batches=self.sampler.num_micro_batches, step=self.step, seed=self.seed
        )
        self.members.commit(self.step)  # live mode: the step counts on every member or on none
        self.optimizer.step()
        return results

    def retry(self, work: Callable[[], T]) -> T:
        """work() (collectives of your own between steps), done again if a member is lost in it."""
        return self.driver.run(work)

    def _handle(self) -> ReplicaHandle:
        if self.handle is None:
            raise InternalError("LiveLoop has no replica (it was released and not made again)")
        return self.handle

    def _cut(self) -> tuple[Iterator[list[int]], int]:
        """This rank's micro-batches for the rest of the epoch, and the steps left in it."""
        return iter(self.sampler), self.sampler.num_steps()

    # ---- state ----------------------------------------------------------------------------------------------

    def _register(self) -> StateRegistry:
        """The loop's state entries (trainer/run/registry.py): what a replacement receives."""
        registry = StateRegistry()
        registry.register_state_dict_fn("model", self._load_model, self.model.state_dict, uses=Use.TRANSFER)
        registry.register("optimizer", self.optimizer, uses=Use.TRANSFER)
        registry.register("sampler", self.sampler, uses=Use.TRANSFER)
        registry.register_state_dict_fn("step", self._load_step, lambda: self.step, uses=Use.TRANSFER)
        registry.register_state_dict_fn("state", self._load_objects, self._save_objects, uses=Use.TRANSFER)
        registry.register_state_dict_fn(
            "faults", self._load_faults, lambda: self.faults, uses=Use.TRANSFER, required=False
        )
        # the run's time account (lockstep.goodput()): a replacement carries on from rank 0's
        registry.register_state_dict_fn(
            "goodput", ACCOUNT.load_state_dict, ACCOUNT.state_dict, uses=Use.TRANSFER, required=False
        )
        return registry

    def state_dict(self) -> dict[str, Any]:
        """Everything a replacement (or a resume) needs to continue at this step boundary."""
        return self.registry.snapshot(Use.TRANSFER)

    def load_state_dict(self, tree: Mapping[str, Any]) -> None:
        receiving = isinstance(self.members, Members) and self.members.group.needs_state
        if not receiving:  # a resume from your own checkpoint: the time since it is no training
            ACCOUNT.arriving = "restart" if restart_attempt() else "new job"
        self.registry.restore(tree, Use.TRANSFER)
        ACCOUNT.arriving = "transfer"

    def _load_model(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state)

    def _load_step(self, step: int) -> None:
        self.step = int(step)

    def _save_objects(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.state.items()}

    def _load_objects(self, states: Mapping[str, Any]) -> None:
        for name, obj in self.state.items():
            obj.load_state_dict(states[name])

    def _load_faults(self, faults: list[dict[str, Any]]) -> None:
        self.faults = list(faults)

    # ---- live mode: what runtime/membership/recovery.py asks of the loop (its Recoverable) ---------------

    def release_replica(self) -> None:
        # Nothing may keep the old group alive: destroying it closes its sockets.
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def rebuild_replica(self, topology: Topology) -> None:
        self.handle = replicate(self.model, policy=self.policy)

    def discard_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # the abandoned step's partial gradients

    def marks(self) -> dict[str, Any]:
        return {"step": self.step}

    def reconcile(self, mark: str) -> None:
        raise InternalError(f"LiveLoop has no progress mark {mark!r} to reconcile")

    def reshard(self, topology: Topology) -> None:
        state = self.sampler.state_dict()
        self.sampler.num_replicas, self.sampler.rank = topology.world_size, topology.rank
        self.sampler.load_state_dict(state)

    def share_shards(self, holders: list[int]) -> None:
        """Nothing: LiveLoop runs replicated models only."""

    def regrouped(self, fault: Fault) -> None:
        """Nothing of the loop's own: a program of yours logs what it keeps."""


class Alone:
    """LiveLoop outside live mode (a plain `lockstep run`, torchrun): the group never changes, a failure is
    the program's own."""

    def __init__(self) -> None:
        self.driver = StepDriver()

    def attach(self, loop: LiveLoop) -> None:
        pass

    def admit_joiners(self, step: int) -> bool:
        return False

    def commit(self, step: int) -> None:
        pass


class Members:
    """LiveLoop in live mode: the group's recovery (runtime/membership/recovery.py), with the loop as its
    Recoverable once the replica exists."""

    def __init__(self, group: LiveGroup[Topology]) -> None:
        self.group = group
        self.driver = StepDriver(StartUpRecovery(group))  # until the loop exists: the start-up's collectives

    def attach(self, loop: LiveLoop) -> None:
        """The loop's replica exists: from now on a loss recovers it; a replacement receives its state."""
        self.recovery = LiveRecovery(self.group, loop)
        self.driver = StepDriver(self.recovery)
        loop.faults = self.recovery.startup_faults()  # members lost before this loop began
        if self.group.needs_state:
            self.recovery.receive_state()

    def admit_joiners(self, step: int) -> bool:
        """Replacements join at the top of a step (a loss in it raises: the loop's driver recovers)."""
        return self.recovery.admit_joiners(step)

    def commit(self, step: int) -> None:
        self.group.commit(step)


def _take(iterator: Iterator[list[int]], count: int) -> list[list[int]]:
    out = []
    for _ in range(count):
        batch = next(iterator, None)
        if batch is None:
            break
        out.append(batch)
    return out
