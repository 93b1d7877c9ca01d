"""The reducer: averages gradients across ranks in buckets, overlapping communication with backward.

Design note. One training step goes through four phases; the same names label the code below, and the
reducer's `phase` (phase.py: IDLE -> ARMED -> REDUCING -> FINALIZING -> IDLE) says which one it is in.

- pre_forward: (driven by state.py) rebuild the buckets once after the first synced step from rank 0's
  observed ready order (kept as they are, memory and views, when that order gives the same layout: the
  common case). After a synced forward the reducer is ARMED (`ArmedForward`, torch's
  prepare_for_backward): with find_unused_parameters it walks the autograd graph from the outputs to
  find the parameters this rank did not use.
- post_accumulate_grad: a hook per parameter fires once its `.grad` holds this backward's gradient. The
  first one of an armed forward starts the step (REDUCING: `StepState`, step.py); `torch.autograd.grad`
  calls never accumulate into `.grad`, so they never start one (gradient penalties work as with torch).
  Large gradients are copied into their bucket right away (scaled by 1/world on the way, one pass);
  a bucket of many small gradients is copied in one `_foreach_copy_` when it is complete. A gradient of
  4 MiB or more, and every sparse gradient, has a "solo" bucket and is reduced in `.grad` itself (no
  copy in or out, no buffer memory), except with gradient_as_bucket_view for dense ones. The drop-in
  class lays buckets out as torch does instead (SyncPolicy.torch_bucket_layout, bucket_plan.py): no
  solo buckets. After a synced step, small gradients report through C hooks drained in order by one
  Python hook per bucket (fast_hooks.py).
- launch: a complete bucket goes to the communication hook (torch's contract:
  hook(state, GradBucket) -> Future[Tensor]), strictly in bucket order on every rank: bucket 3 waits
  for bucket 2, or collectives would pair up differently on different ranks (bucket_launch.py: the
  reducer's `launcher`, from copy-in to write-back).
- finalize: an autograd engine callback at the end of the backward (queued from the outputs' gradient
  hooks, so that it belongs to the outermost backward even under reentrant checkpointing). A pass that
  started no step (an autograd.grad call) leaves the reducer ARMED. Otherwise (FINALIZING) parameters
  without gradient are filled in (zeros, or their no_sync-accumulated grads) and their buckets
  launched, so that every rank issues the same collectives; the ranks agree on unused parameters
  (unused.py), wait, and write the averages back into `.grad`; then the reducer is IDLE again.

The reducer holds two parts: `launcher` (a BucketLauncher, bucket_launch.py: the buckets, the
communication hook, copy-in, launch, wait and write-back, the missing-gradient agreement) and `arrivals`
(GradientArrivals, arrivals.py: the per-parameter hooks and what arrived when). The phases below drive
both; the state the phases own (the phase, the rebuild's progress) is the reducer's own.

The optimizer's step is the user's, after backward, unless an optimizer is overlapped
(`handle.overlap_optimizer`): then the launcher's stepper (step.py's ParamStepper, handed in by
engine/replica/mode.py through `step_with`; this module imports no optimizer) steps each bucket's parameters
once its averages are back: at a later bucket's launch (REDUCING), after its wait in finalize, and the
last bucket once the missing-gradient verdict is read.

All bucket arithmetic runs under no_grad: with backward(create_graph=True) gradients carry a graph of
their own, which the reduction leaves alone (torch's DDP does not sync higher-order gradients either).
Inside join() (join.py) a rank that ran out of inputs mirrors launch and finalize with zeros
(shadow_backward: SHADOWING, shadow.py). join.py uses will_rebuild, maybe_rebuild, set_divisor and
shadow_backward, nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lockstep.engine.buckets.arrivals import GradientArrivals
from lockstep.engine.buckets.bucket_launch import BucketLauncher, CommHook
from lockstep.engine.buckets.bucket_layout import BucketSpec, complete_order
from lockstep.engine.buckets.bucket_memory import Bucket
from lockstep.engine.buckets.phase import (
    ARMED,
    FINALIZING,
    IDLE,
    LEGAL,
    REDUCING,
    SHADOWING,
    Phase,
    illegal_message,
)
from lockstep.engine.buckets.step import ArmedForward, ParamStepper, StepState
from lockstep.engine.buckets.unused import unreached
from lockstep.engine.core.bucket_settings import BucketSettings
from lockstep.errors import InternalError, UnusedParameterError, UsageError
from lockstep.runtime.progress import BACKWARD, PROGRESS
from lockstep.torch_private import execution_engine

# A gradient this large is reduced in place in its own bucket: no copy into a flat buffer and back
# (two passes over memory saved, and the buffer's memory), at the price of one more collective.
SOLO_BUCKET_BYTES = 4 * 1024 * 1024


class Reducer:
    """The four phases of a step (see the module docstring) over its launcher's buckets and its arrivals;
    one StepState per backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        settings: BucketSettings,
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        world_size: int,
        sparse: Sequence[bool],
        device: torch.device,
        stepper: ParamStepper,
    ) -> None:
        self.launcher = launcher = BucketLauncher(
            params,
            names,
            settings,
            group,
            rank=rank,
            world_size=world_size,
            sparse=sparse,
            device=device,
            dropped=lambda: self.arrivals.hooks.forget_buckets(),
            stepper=stepper,
        )
        self.arrivals = GradientArrivals(launcher, self, launcher.params)
        # the launcher's fixed facts, read by join.py, ddp.py, the tuner and handle.stats()
        self.params, self.settings, self.group, self.device = launcher.params, settings, group, device
        self.world, self.stats, self._tag = world_size, launcher.stats, launcher.tag
        self._n = len(self.params)
        self.rebuilt = False
        # ready order of the first synced step, for the rebuild; torch never rebuilds with find_unused_parameters
        self.arrivals.order = (
            None if launcher.planner.skips_rebuild(static_graph=settings.static_graph) else []
        )
        self._order_complete = False
        self._static_unused: list[int] = []  # learned by static_graph in its first step, with its counts
        # torch's ddp_graph_static: no two synced forwards (find_unused_parameters) left different unused
        self.graph_static = True
        self._last_unused: frozenset[int] | None = None
        self.phase: Phase = IDLE  # changed in `_enter` only; `arrivals.armed` and `.step` next to it
        self._queued = False  # finalize is queued on the running backward
        self.drain = self.arrivals.drain
        self._t_output_grad = 0.0  # when this backward reached the outputs
        self._rebuild(None)
        self.initial_layout: list[BucketSpec] = launcher.layout

    # ---------------------------------------------------------------- the parts, as others read them

    @property
    def buckets(self) -> list[Bucket]:
        return self.launcher.buckets

    @property
    def layout(self) -> list[BucketSpec]:
        """The buckets now, in launch order."""
        return self.launcher.layout

    @property
    def step(self) -> StepState | None:
        """The backward under way (None outside one)."""
        return self.arrivals.step

    @property
    def stepper(self) -> ParamStepper:
        return self.launcher.stepper

    def step_with(self, stepper: ParamStepper) -> None:
        """engine/replica/mode.py: from the next synced backward on, `stepper` steps the parameters bucket by bucket."""
        self.launcher.stepper = stepper

    def layout_at(self, cap_bytes: int) -> list[BucketSpec]:
        return self.launcher.layout_at(cap_bytes)

    def relayout(self, cap_bytes: int) -> None:
        self.launcher.relayout(cap_bytes)

    def set_divisor(self, num_ranks: int) -> None:
        self.launcher.set_divisor(num_ranks)

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        self.launcher.register_comm_hook(state, hook)

    def _enter(self, phase: Phase) -> None:
        """The one place the phase changes (a few times per step); phase.py's LEGAL says what may follow."""
        if phase not in LEGAL[self.phase]:
            raise InternalError(illegal_message(self.phase, phase))
        self.phase = phase

    def _rebuild(self, order: Sequence[int] | None) -> None:
        solo = None if self.settings.gradient_as_bucket_view else SOLO_BUCKET_BYTES
        self.launcher.build(order, solo_bytes=solo)

    def enable_static_graph(self) -> None:
        """torch's _set_static_graph(): before the first backward, like static_graph=True."""
        self.launcher.static_graph = True
        if self.arrivals.order is None and not self.rebuilt:
            self.arrivals.order = []  # torch rebuilds under a static graph, find_unused_parameters or not

    # ---------------------------------------------------------------- pre_forward

    def will_rebuild(self) -> bool:
        """True when the next synced pre_forward rebuilds the buckets (once, after the first synced step)."""
        return self.arrivals.order is not None and self._order_complete

    def maybe_rebuild(self, *, force: bool = False) -> None:
        """pre_forward, once after the first synced step: every rank adopts rank 0's ready order.

        `force`: a rank that ran out of inputs inside join() joins the others' rebuild (its own order may
        be incomplete; rank 0's is what counts, and it sends what it saw).
        """
        arrivals = self.arrivals
        if not force and (arrivals.order is None or not self._order_complete):
            return
        from lockstep.runtime.collectives import broadcast_object

        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        order = broadcast_object(complete_order(arrivals.order or [], self._n), src=src, group=self.group)
        arrivals.order = None
        self._rebuild(order)
        self.rebuilt = True

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor], t_forward_start: float) -> None:
        """Arm for the backward of this forward (the last synced forward wins, like torch)."""
        self.drain()  # pre_forward drained too; this catches a backward run inside the forward itself
        arrivals = self.arrivals
        if arrivals.static_hits is not None:
            forward_unused = self._static_unused
        elif self.settings.find_unused_parameters and not self.launcher.static_graph:
            forward_unused = unreached(outputs, arrivals.index_of)
            self._note_unused(frozenset(forward_unused))
        else:
            forward_unused = []
        if self.phase in (REDUCING, FINALIZING):
            raise UsageError(_abandoned_step_message(self._tag, self.phase))
        self._enter(ARMED)
        self._queued = False  # no backward of this model runs now: one that raised dropped its callback
        arrivals.armed, arrivals.step = ArmedForward(forward_unused, t_forward_start), None
        self._t_output_grad = 0.0
        for t in outputs:
            if t.requires_grad:
                # A pre-hook on the output's node: what a tensor hook is underneath, at half the cost
                node = t.grad_fn
                if node is not None:
                    node.register_prehook(self._on_output_grad)
                else:
                    t.register_hook(self._on_output_grad)

    def _note_unused(self, unused: frozenset[int]) -> None:
        if self._last_unused is not None and unused != self._last_unused:
            self.graph_static = False
        self._last_unused = unused

    def _on_output_grad(self, _grad: object) -> None:
        # Queued from an output's gradient, the callback belongs to the outermost backward, even when
        # reentrant checkpointing runs nested backwards that fire parameter hooks.
        if self.arrivals.armed is not None and not self._queued:
            self._queue_finalize()
            if self.arrivals.step is None:  # the backward starts here (a fast hook may be the first to fire)
                self._t_output_grad = time.perf_counter()
                PROGRESS.set_phase(BACKWARD)

    def _queue_finalize(self) -> None:
        self._queued = True
        execution_engine.queue_callback(self.finalize)

    # ---------------------------------------------------------------- post_accumulate_grad

    def attach_hooks(self) -> None:
        """Register a hook per parameter (the Python one: fast hooks are chosen after a synced step)."""
        self.arrivals.hooks.attach()

    def detach_hooks(self) -> None:
        self.arrivals.hooks.detach()

    @property
    def _fast(self) -> bytearray:
        """1 where parameter i has a fast hook now (fast_hooks.py)."""
        return self.arrivals.hooks.fast

    def start_step(self) -> StepState:
        """ARMED -> REDUCING: the first gradient of the armed forward's backward arrived."""
        arrivals, launcher = self.arrivals, self.launcher
        forward_unused = arrivals.armed.unused if arrivals.armed is not None else ()
        # before REDUCING: an overlapped optimizer's step left unfinished raises with nothing reduced yet
        launcher.stepper.begin(forward_unused, launcher.where)
        self._enter(REDUCING)
        first_static = self._first_static
        step = arrivals.step = StepState(self._n, count_hits=launcher.static_graph, defer=first_static)
        if self._t_output_grad:
            step.t_backward, self._t_output_grad = self._t_output_grad, 0.0
        PROGRESS.set_phase(BACKWARD)
        for b in launcher.buckets:
            b.pending, b.future, b.hook_buffer, b.written = len(b.params), None, b.buffer, False
        if not self._queued:
            self._queue_finalize()
        for i in forward_unused:
            arrivals.mark_ready(step, i)
        return step

    @property
    def _first_static(self) -> bool:
        # static_graph's first step reduces at the end: how often each parameter fires is not known yet.
        return self.launcher.static_graph and self.arrivals.static_hits is None

    # ---------------------------------------------------------------- finalize

    def finalize(self) -> None:
        """End of backward: fill in, launch the rest, agree on unused parameters, wait, write back."""
        self._queued = False
        self.drain()
        step = self.arrivals.step
        if step is None:
            return  # a pass that accumulated no gradient (autograd.grad): stay armed for the real backward
        self._enter(FINALIZING)
        if torch.is_grad_enabled():  # backward(create_graph=True); otherwise the engine runs us without grad
            with torch.no_grad():
                verdict = self._finalize(step)
        else:
            verdict = self._finalize(step)
        if verdict:
            raise UnusedParameterError(verdict)

    def _finalize(self, step: StepState) -> str:
        launcher = self.launcher
        t_end_backward = time.perf_counter()
        launcher.stamp_finished(step.next_bucket, t_end_backward)
        missing = step.missing()
        step.missing_count = len(missing)
        step.defer = False
        for i in missing:
            self.arrivals.mark_ready(
                step, i
            )  # zeros or no_sync-accumulated grads: every rank launches every bucket
        while step.next_bucket < len(launcher.buckets):
            launcher.launch(step, launcher.buckets[step.next_bucket])
            step.next_bucket += 1
        learned = self.arrivals.static_hits is not None
        verdict = launcher.agree_on_unused(missing, self.arrivals.used, learned_static=learned)
        launcher.write_back()
        if verdict is None:  # the signal travelled in the last bucket
            last = launcher.buckets[-1]
            reduced = last.hook_buffer
            if last.last_element is not None and (reduced is last.buffer or reduced is last.storage):
                reduced = last.last_element  # the same element, already a view: no reshape per step
            verdict = launcher.read_missing_signal(reduced, len(missing), missing)
        launcher.stepper.end(launcher.buckets, ok=not verdict)
        self._finish_step(step, t_end_backward, missing)
        return verdict

    def _finish_step(self, step: StepState, t_end_backward: float, missing: list[int]) -> None:
        """FINALIZING -> IDLE: the step's statistics, the fast hooks' choice, the rebuild's order."""
        arrivals, launcher = self.arrivals, self.launcher
        learned_static = self._first_static
        if learned_static:
            arrivals.static_hits = [max(h, 1) for h in step.hits or [0] * self._n]
            self._static_unused = list(missing)
        launcher.record_stats(step, arrivals.armed, t_end_backward)
        self._enter(IDLE)
        arrivals.armed = arrivals.step = None
        arrivals.used = bytearray(self._n)
        arrivals.hooks.choose(
            launcher.buckets,
            allowed=launcher.communicates
            and arrivals.order is None
            and not launcher.static_graph
            and not self.settings.find_unused_parameters,
        )
        PROGRESS.end_step()
        if learned_static and self.settings.torch_bucket_layout and arrivals.order is not None:
            arrivals.order = []  # torch observes the ready order in the second step of a static graph
        else:
            self._order_complete = arrivals.order is not None

    # ---------------------------------------------------------------- join's shadow step (shadow.py)

    def shadow_backward(self) -> None:
        """The collectives of a synced backward, with zeros, on a rank that ran out of inputs (join()):
        in the SHADOWING phase, and back to the phase it came from; raises what the training ranks raise."""
        if self.world == 1:
            return
        came_from = self.phase
        self._enter(SHADOWING)
        self.arrivals.used = bytearray(self._n)  # this rank used nothing in the step it shadows
        verdict = self.launcher.shadow(
            self.arrivals.used, learned_static=self.arrivals.static_hits is not None
        )
        if self._first_static:  # the training ranks learned their pattern in the step shadowed here
            self.arrivals.static_hits, self._static_unused = [1] * self._n, []
        self._enter(came_from)
        if verdict:
            raise UnusedParameterError(verdict)


def _abandoned_step_message(tag: str, phase: Phase) -> str:
    """A synced forward after a backward that raised once its reduction had begun (torch's error)."""
    return (
        f"{tag}Expected to have finished reduction in the prior iteration before starting a new one. The "
        f"previous backward raised while its gradients were being averaged (phase {phase.name}), so its "
        "collectives may have been issued on some ranks and not on others, and the replicas may differ. "
        "This model cannot go on: wrap it again from a checkpoint (lockstep.replicate or "
        "DistributedDataParallel), as with torch's DDP, which raises the same error"
    )
