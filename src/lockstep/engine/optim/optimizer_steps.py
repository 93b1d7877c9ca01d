"""When the reducer steps the optimizer: never (plain), or each bucket as soon as its averages are back.

The reducer (reducer.py) is handed one stepper (step.py's `ParamStepper`; its launcher holds it) and
calls it at four points of its phases: `begin` when a synced backward starts (REDUCING), `poll` after
each bucket launch while backward runs, `reduced` after each bucket's wait and write-back in finalize,
and `end` once finalize knows whether the step stands. step.py's `NoStepper` (the default; `PlainSteps`
here) does nothing at any of them; the optimizer steps when the user calls it. `OverlappedSteps`
(`handle.overlap_optimizer`; engine/replica/mode.py builds it and hands it to the reducer) steps an
OverlappedOptimizer (overlapped_optimizer.py) bucket by bucket:

- during backward, at each later bucket's launch, every earlier bucket whose all-reduce has completed
  (polled with `Future.done()`, never in a future callback: that would run the optimizer on gloo's
  thread) is written back into `.grad` and its parameters step, while backward goes on;
- in finalize, each remaining bucket steps right after its wait, while the later ones are still in
  flight; the last bucket steps only once the missing-gradient verdict it carries is read.

Buckets holding a parameter this rank's forward did not reach (find_unused_parameters) wait for
finalize: whether any rank used it, and so whether its `.grad` is written at all, is known only after
the ranks agree. A step that ends in an error after some buckets stepped marks the optimizer broken:
its next step() raises: the model is half a step ahead, and no plain step can finish it.

With a ShardedOptimizer, each bucket's step takes the parameters this rank owns, and the owners'
broadcasts of that bucket's parameters start right after it (shard_overlap.py, on a group of their own;
`OverlappedSteps` reaches them through the optimizer's `params_stepped`, whole or sharded alike);
the optimizer's step() waits for them. A failed backward finishes the broadcasts on every rank alike and
always marks the optimizer broken (whether some rank stepped a bucket is not known here without a collective).

Which optimizers overlap: those whose step of one parameter reads nothing but that parameter's gradient
and state, and whose overlapped step is tested (torch.optim.SGD, Adam, AdamW, exactly those classes: a
subclass may override step; shard_units.ELEMENTWISE_OPTIMIZERS is the one table). A step
that needs every gradient first (clipping by global norm, the fp16 GradScaler's inf check) falls back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from lockstep.engine.buckets.bucket_memory import Bucket
from lockstep.engine.buckets.step import NoStepper, ParamStepper
from lockstep.engine.optim.overlapped_optimizer import OverlappedOptimizer
from lockstep.engine.optim.shard_units import OVERLAPPED
from lockstep.plan import Plan

PER_PARAMETER_OPTIMIZERS = OVERLAPPED  # shard_units.ELEMENTWISE_OPTIMIZERS, the one table
ACCUMULATE_REASON = (
    "accumulate() scales the averaged gradients into the mean over the step's micro-batches only after "
    "the last backward"
)
DETERMINISTIC_REASON = (
    "SyncPolicy(deterministic=True) sums the gradients exactly after all of a step's backwards, "
    "not bucket by bucket"
)


def fallback_reason(optimizer: torch.optim.Optimizer, plan: Plan) -> str | None:
    """Why `optimizer` cannot step bucket by bucket in the run `plan` (the one its door built: the
    overlap's fallbacks are the table's, e.g. clipping, the fp16 scaler, live mode), or None when it can."""
    if type(optimizer) not in PER_PARAMETER_OPTIMIZERS:
        known = ", ".join(f"torch.optim.{cls.__name__}" for cls in PER_PARAMETER_OPTIMIZERS)
        return (
            f"lockstep does not know that {type(optimizer).__module__}.{type(optimizer).__qualname__} "
            f"steps each parameter from its own gradient alone (it overlaps {known})"
        )
    rule = plan.fallback("overlap_optimizer")
    return None if rule is None else rule.reason


def overlap_plan(
    plan: Plan, *, clip_grad_norm: bool, scaler: Any, sharded: bool = False, live: bool = False
) -> Plan:
    """The native API's plan for `handle.overlap_optimizer`: the replica's (its SyncPolicy's, built when
    the policy was made) with what the call says: the overlap, clipping, an enabled fp16 GradScaler, a
    sharded optimizer, live mode's sharding (PlanRefused where the table refuses them)."""
    fp16 = scaler is not None and scaler.is_enabled()
    settings = dataclasses.replace(
        plan.settings,
        overlap_optimizer=True,
        clip_grad_norm=1.0 if clip_grad_norm else None,
        precision="fp16" if fp16 else plan.settings.precision,
        shard_optimizer=sharded,
        live=live or plan.settings.live,
    )
    return Plan.of(settings)


# The interface the reducer calls and its default (step.py), under the names they had here.
OptimizerSteps = ParamStepper
PlainSteps = NoStepper


class OverlappedSteps:
    """Steps an OverlappedOptimizer bucket by bucket (see the module docstring)."""

    def __init__(self, optimizer: OverlappedOptimizer) -> None:
        self.optimizer = optimizer
        self._active = False  # this backward's buckets step in the engine
        self._suspended: str | None = None  # why the steps in progress fall back (accumulate())
        self._deferred: set[int] = set()  # buckets with a parameter this rank's forward did not reach
        self._done: set[int] = set()  # buckets stepped in this backward

    def begin(self, unused: Sequence[int], where: Sequence[tuple[Bucket, int]]) -> None:
        """A synced backward starts: the previous step must be finished (raises before anything is reduced)."""
        self.optimizer.check_no_pending()
        self._done = set()
        if self._suspended is not None:
            self.optimizer.suspend(self._suspended)
            self._active = False
            return
        self._active = True
        self._deferred = {where[i][0].index for i in unused}
        self.optimizer.params_stepped.begin()

    def poll(self, buckets: Sequence[Bucket], launched: int, write_back: Callable[[Bucket], None]) -> None:
        """During backward: step every launched bucket (but the last) whose all-reduce has completed."""
        if not self._active:
            return
        for b in buckets[: min(launched, len(buckets) - 1)]:
            if b.written or b.future is None or b.index in self._deferred or not b.future.done():
                continue
            write_back(b)
            self._step(b, in_backward=True)
            self.optimizer.buckets_stepped_in_backward += 1

    def reduced(self, b: Bucket, *, last: bool) -> None:
        """In finalize, bucket b was waited for and written back: it steps now (the last one at `end`)."""
        if self._active and not last and b.index not in self._done:
            self._step(b)
            self.optimizer.buckets_stepped_at_finalize += 1

    def end(self, buckets: Sequence[Bucket], *, ok: bool) -> None:
        """finalize knows the verdict: the written buckets not stepped yet step (ok), or the step is broken."""
        if not self._active:
            return
        self._active = False
        params = self.optimizer.params_stepped
        if not ok:
            broken_elsewhere = params.abandon(buckets)  # sharded: the broadcasts end alike on every rank
            if self.optimizer.pending or broken_elsewhere:
                self.optimizer.broke(
                    "the previous backward raised after the engine had stepped some buckets' parameters "
                    "(overlap_optimizer): the model is half a step ahead of its last good state, which no "
                    "step can finish. Load a checkpoint and train on from there"
                )
            return
        for b in buckets:
            if b.written and b.index not in self._done:
                self._step(b)
                self.optimizer.buckets_stepped_at_finalize += 1
        params.flush(buckets)

    @contextmanager
    def suspended(self, reason: str) -> Iterator[None]:
        """The synced backwards inside fall back to the plain step (said once per reason)."""
        before, self._suspended = self._suspended, reason
        try:
            yield
        finally:
            self._suspended = before

    def stats(self) -> dict[str, Any]:
        """For EngineStats.extras: how many buckets stepped during backward and at its end, so far."""
        optimizer = self.optimizer
        return {
            "optimizer_buckets_stepped_in_backward": optimizer.buckets_stepped_in_backward,
            "optimizer_buckets_stepped_at_finalize": optimizer.buckets_stepped_at_finalize,
            **optimizer.params_stepped.stats(),  # sharded: the broadcasts launched in backward
        }

    def _step(self, b: Bucket, *, in_backward: bool = False) -> None:
        self._done.add(b.index)
        with torch.no_grad():
            self.optimizer.step_params(b.params)
        self.optimizer.params_stepped.stepped(b, in_backward=in_backward)  # sharded: the owners' broadcasts
