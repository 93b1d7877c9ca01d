"""The reducer's per-parameter path: a parameter's `.grad` is complete for this backward.

This runs once per parameter and backward, so it is written for the fewest Python frames: the hook
(`post_accumulate_grad`, registered as `functools.partial(post_accumulate_grad, i)` by fast_hooks.py)
handles the common case itself (a step under way, settled buckets, first time ready, no graph to keep
out): it marks the parameter ready, copies a large gradient into its bucket scaled by 1/world (one
pass), and launches the bucket when it is complete. Everything else (the first gradient of a step,
no_sync, static_graph's counts, a gradient that arrives twice, backward(create_graph=True)) goes
through `arrived`.

`GradientArrivals` sits between BucketLauncher (bucket_launch.py: copy-in, launch, write-back) and the
Reducer (reducer.py: the step's phases), which provides `start_step`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lockstep.engine.bucket_launch import BucketLauncher
from lockstep.engine.phase import REDUCING, Phase
from lockstep.engine.step import ArmedForward, StepState
from lockstep.errors import InternalError


class GradientArrivals(BucketLauncher):
    """The reducer's per-parameter hooks' side (see the module docstring); the Reducer sets the state."""

    step: StepState | None
    armed: ArmedForward | None
    phase: Phase
    order: list[int] | None
    used: bytearray
    _arrivals: list[torch.Tensor]
    drain: Callable[[], None]
    _static_hits: list[int] | None

    def start_step(self) -> StepState:
        """ARMED -> REDUCING (the Reducer's): the first gradient of the armed forward's backward arrived."""
        raise InternalError("lockstep bug: GradientArrivals without a Reducer's start_step")

    def post_accumulate_grad(self, i: int, _param: torch.Tensor | None = None) -> None:
        """The per-parameter Python hook: param i's .grad is complete for this backward.

        Registered as `functools.partial(post_accumulate_grad, i)`. Parameters reported by a fast hook
        before this one are processed first, in their order.
        """
        if self._arrivals:
            self.drain()
        step = self.step
        if (
            step is None
            or step.hits is not None
            or step.ready[i]
            or self.order is not None
            or torch.is_grad_enabled()
        ):
            self.arrived(i)
            return
        # The common case, `arrived` and `_mark_ready` inlined (one Python frame per parameter, not four):
        # a step under way, settled buckets, first time ready, no graph to keep out.
        self.used[i] = step.ready[i] = 1
        b, pos = self.where[i]
        if b.eager and self.communicates:
            grad = b.params[pos].grad
            if self._prescale and not b.widen and grad is not None and not grad.is_sparse:
                torch.mul(grad, self._inv, out=b.views[pos])
            else:
                self._copy_in_one(b, pos)
        b.pending -= 1
        if b.pending == 0:
            b.last_ready = i
            if not step.defer:
                self.launch_completed(step)
                if self.phase is REDUCING:
                    self.optimizer_steps.poll(self.buckets, step.next_bucket, self._write_back_one)

    def arrived(self, i: int) -> None:
        """Param i's gradient is complete (the common case, a step under way and first time ready, in
        the fewest Python calls: this runs once per parameter and backward)."""
        self.used[i] = 1
        if self.armed is None:
            return  # no_sync, eval, or a backward that did not follow a synced forward: accumulate locally
        step = self.step
        if step is not None and step.hits is None and not step.ready[i] and not torch.is_grad_enabled():
            self._mark_ready(step, i)
            return
        if torch.is_grad_enabled():  # backward(create_graph=True): keep the reduction out of the graph
            with torch.no_grad():
                self._accumulated(i)
        else:
            self._accumulated(i)

    def _accumulated(self, i: int) -> None:
        step = self.step or self.start_step()
        if step.hits is not None:
            step.hits[i] += 1
            if self._static_hits is not None and step.hits[i] < self._static_hits[i]:
                return
        if step.ready[i]:
            self._ready_again(i)
            return
        self._mark_ready(step, i)

    def _mark_ready(self, step: StepState, i: int) -> None:
        step.ready[i] = 1
        if self.order is not None:
            self.order.append(i)
        b, pos = self.where[i]
        if b.eager and self.communicates:
            self._copy_in_one(b, pos)
        b.pending -= 1
        if b.pending == 0:
            b.last_ready = i
        if b.pending == 0 and not step.defer:
            self.launch_completed(step)
            if self.phase is REDUCING:  # in finalize, buckets step after the ranks agree on unused ones
                self.optimizer_steps.poll(self.buckets, step.next_bucket, self._write_back_one)
