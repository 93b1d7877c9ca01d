"""The reducer's per-parameter path: a parameter's `.grad` is complete for this backward.

This runs once per parameter and backward, so it is written for the fewest Python frames. What a
gradient that counts for the step does is written once, `mark_ready`: it marks the parameter ready,
copies a large gradient into its bucket scaled by 1/world (one pass), and launches the bucket when it is
complete. The hook (`post_accumulate_grad`, registered as `functools.partial(post_accumulate_grad, i)`
by fast_hooks.py) calls it directly in the common case (a step under way, first time ready, no graph to
keep out), and so does the fast hooks' drain (fast_hooks.py); everything else (the first gradient of a
step, no_sync, static_graph's counts, a gradient that arrives twice, backward(create_graph=True)) goes
through `arrived`, and finalize marks the missing ones.

`GradientArrivals` is a part the Reducer (reducer.py) holds, as `arrivals`, next to its BucketLauncher
(bucket_launch.py: copy-in, launch, write-back), which it is handed. It owns what arrived when: the
armed forward and the step under way (set by the Reducer's phases), the parameters used since the last
synced step, the ready order recorded for the rebuild, static_graph's learned counts, and the hooks
(fast_hooks.py). Of its owner it needs only the phase and `start_step` (`StepOwner`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from lockstep.engine.buckets.bucket_launch import BucketLauncher
from lockstep.engine.buckets.fast_hooks import FastHooks
from lockstep.engine.buckets.phase import REDUCING, Phase
from lockstep.engine.buckets.step import ArmedForward, StepState


class StepOwner(Protocol):
    """What the arrivals need of the reducer that holds them."""

    @property
    def phase(self) -> Phase: ...

    def start_step(self) -> StepState:
        """ARMED -> REDUCING: the first gradient of the armed forward's backward arrived."""
        ...


class GradientArrivals:
    """The reducer's per-parameter hooks' side (see the module docstring)."""

    def __init__(self, launcher: BucketLauncher, owner: StepOwner, params: Sequence[torch.Tensor]) -> None:
        self.launcher, self._owner = launcher, owner
        n = len(params)
        # The step's data, set by the reducer's phases: `armed` from ARMED to the step's end, `step` from
        # REDUCING on. The per-parameter path tests them, not the phase: it needs them anyway.
        self.armed: ArmedForward | None = None
        self.step: StepState | None = None
        self.order: list[int] | None = (
            None  # the ready order being recorded for the rebuild (the reducer's choice)
        )
        self.used = bytearray(n)  # parameters used since the last synced step (no_sync included)
        self.static_hits: list[int] | None = None  # how often each parameter fires, learned by static_graph
        self.index_of = {id(p): i for i, p in enumerate(params)}
        self.start_step = owner.start_step
        self.hooks = FastHooks(self, params)
        self._reported = self.hooks.arrivals  # what fast hooks reported, not yet drained
        self.drain = self.hooks.drain  # bound here: a trigger reaches it without a frame in between

    def post_accumulate_grad(self, i: int, _param: torch.Tensor | None = None) -> None:
        """The per-parameter Python hook: param i's .grad is complete for this backward.

        Registered as `functools.partial(post_accumulate_grad, i)`. Parameters reported by a fast hook
        before this one are processed first, in their order.
        """
        if self._reported:
            self.drain()
        step = self.step
        if step is None or step.hits is not None or step.ready[i] or torch.is_grad_enabled():
            self.arrived(i)
            return
        # The common case, `arrived` inlined: a step under way, first time ready, no graph to keep out
        self.used[i] = 1
        self.mark_ready(step, i)

    def arrived(self, i: int) -> None:
        """Param i's gradient is complete (the common case, a step under way and first time ready, in
        the fewest Python calls: this runs once per parameter and backward)."""
        self.used[i] = 1
        if self.armed is None:
            return  # no_sync, eval, or a backward that did not follow a synced forward: accumulate locally
        step = self.step
        if step is not None and step.hits is None and not step.ready[i] and not torch.is_grad_enabled():
            self.mark_ready(step, i)
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
            if self.static_hits is not None and step.hits[i] < self.static_hits[i]:
                return
        if step.ready[i]:
            self.launcher.ready_again(i)
            return
        self.mark_ready(step, i)

    def mark_ready(self, step: StepState, i: int) -> None:
        """Parameter i's gradient counts for this step: the one per-parameter path, from the Python hook,
        the general path, the fast hooks' drain (fast_hooks.py) and finalize (a missing one: zeros or
        no_sync's). It copies a large gradient into its bucket, scaled by 1/world on the way (the small
        ones are copied at launch), and launches the buckets it completes, in order."""
        step.ready[i] = 1
        if self.order is not None:
            self.order.append(i)
        launcher = self.launcher
        b, pos = launcher.where[i]
        if b.eager and launcher.communicates:
            launcher.copy_in(b, pos)
        b.pending -= 1
        if b.pending == 0:
            b.last_ready = i
            if not step.defer:
                launcher.launch_completed(step)
                # in finalize, buckets step after the ranks agree on unused ones
                if self._owner.phase is REDUCING:
                    launcher.stepper.poll(launcher.buckets, step.next_bucket, launcher.write_back_one)
