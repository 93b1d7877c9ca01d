"""A reducer's buckets from copy-in to write-back: filled, handed to the communication hook in order, waited.

The launch phase of reducer.py's design note, and the waits at the end of finalize. Gradients reach a
bucket's flat buffer scaled by 1/world on the way (one pass) when the built-in hook sums: an eager
bucket (large gradients) is copied into by each parameter's hook (`copy_in`), any other in one
`_foreach_copy_` at launch. A solo bucket hands `.grad` itself to the hook (or a copy when its dtype
or memory layout differ); a sparse one its sparse gradient, divided (not multiplied) by the world as
torch does. A complete bucket goes to the communication hook (torch's contract:
hook(state, GradBucket) -> Future[Tensor]) strictly in bucket order on every rank: bucket 3 waits for
bucket 2, or collectives would pair up differently on different ranks. After the waits,
`write_back_bucket` copies each result into `.grad` (one `_foreach_copy_` per bucket where it can), or makes `.grad` a view
of the bucket (gradient_as_bucket_view).

`BucketLauncher` holds this, the communication hook's settings, the missing-gradient agreement
(unused.py) and the stepper (step.py's ParamStepper: who steps the parameters as buckets come back,
handed in at construction by engine/replica/mode.py: NoStepper until an optimizer is overlapped). The reducer (reducer.py) holds one, as `launcher`, next
to its GradientArrivals (arrivals.py), and drives both through the step's phases.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.buckets.bucket_layout import BucketSpec
from lockstep.engine.buckets.bucket_memory import (
    Bucket,
    GradBucket,
    build_buckets,
    empty_sparse_grad,
    flat_views,
    sum_hook,
)
from lockstep.engine.buckets.bucket_plan import BucketPlanner
from lockstep.engine.buckets.shadow import mirror_backward
from lockstep.engine.buckets.step import ArmedForward, ParamStepper, StepState
from lockstep.engine.buckets.unused import UnusedAgreement
from lockstep.engine.core.bucket_settings import BucketSettings
from lockstep.engine.core.stats import StatsRecorder, union_ms
from lockstep.errors import CommHookResultError, GradientError, InternalError, UsageError, rank_tag
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import wait_tracked
from lockstep.torch_private import FutureBase, foreach_copy_

CommHook = Callable[[Any, "GradBucket"], "torch.futures.Future[Any]"]
_IS_NONE = functools.partial(operator.is_, None)


def _scale(world: int) -> torch.Tensor:
    """1/world as a 0-dim float64 CPU tensor: multiplying by it gives the bits of multiplying by the Python
    float (the kernel takes it as a scalar, in the gradient's dtype), at 2 us a call where the float costs
    6 (it is wrapped into a new tensor on every call)."""
    return torch.tensor(1.0 / world, dtype=torch.float64)


class BucketLauncher:
    """The buckets of one replica's trainable parameters, the communication hook, launch and write-back."""

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
        dropped: Callable[[], None],
        stepper: ParamStepper,
    ) -> None:
        self.params, self.names, self.settings, self.group = list(params), list(names), settings, group
        self.rank, self.world, self.device = rank, world_size, device
        self._n = len(self.params)
        self.tag = rank_tag(rank, world_size)
        self._dropped = dropped  # called when the buckets are about to be built again (the reducer's hooks)
        self.hook: CommHook = sum_hook
        # Whether buckets go through the hook. A world of one skips the built-in sum (nothing to add) but,
        # like torch's DDP, still hands buckets to a user's hook: fp16 compression changes the bits.
        self.communicates = world_size > 1
        self.hook_op = "allreduce (gradient bucket)"  # how the hang watchdog names a bucket's collective
        self.hook_state: Any = group
        self.prescale = True  # the built-in hook sums: gradients are scaled by 1/world on their way in
        self._divisor = world_size
        self.inv = _scale(world_size)
        self.static_graph = settings.static_graph
        self.stats = StatsRecorder()
        self.planner = BucketPlanner(self.params, self.names, sparse, settings)
        self._layout: list[BucketSpec] | None = None
        # the last build's order and solo size: relayout builds again from them at another cap
        self._built_from: tuple[Sequence[int] | None, int | None] = (None, None)
        self.buckets: list[Bucket] = []
        self.where: list[tuple[Bucket, int]] = []  # per parameter: its bucket and its position there
        self.unused = UnusedAgreement(self.names, self.tag, group, device, world_size)
        # who steps the optimizer: the user after backward (NoStepper), or each bucket once back (overlapped)
        self.stepper = stepper

    @property
    def layout(self) -> list[BucketSpec]:
        """The buckets now, in launch order."""
        return list(self._layout or [])

    def build(self, order: Sequence[int] | None, *, solo_bytes: int | None) -> None:
        """The buckets for `order` (None: the parameters' reverse order), built unless they are the same."""
        self._built_from = (order, solo_bytes)
        layout = self.planner.layout(order, static_graph=self.static_graph, solo_bytes=solo_bytes)
        if layout == self._layout:  # the observed order gives the same buckets: keep their memory and views
            return
        self._layout = layout
        status = not self.settings.torch_bucket_layout  # torch's layout has no room for the status element
        # the old buckets' memory goes before the new is allocated: a rebuild never holds both (+1 model's
        # worth of gradients at the peak otherwise)
        for b in self.buckets:
            b.release()
        self.buckets, self.where = [], []
        self._dropped()  # every other reference to the old buckets goes too
        self.buckets, self.where = build_buckets(layout, self.params, self.planner.dtypes, status=status)

    def layout_at(self, cap_bytes: int) -> list[BucketSpec]:
        """bucket_tuner.py: the buckets the last build's order gives at `cap_bytes`, not built."""
        order, solo_bytes = self._built_from
        return self.planner.layout(
            order, static_graph=self.static_graph, solo_bytes=solo_bytes, cap_bytes=cap_bytes
        )

    def relayout(self, cap_bytes: int) -> None:
        """bucket_tuner.py, between steps: the buckets built again at `cap_bytes`, in the last build's order."""
        self.planner.cap_bytes = cap_bytes
        order, solo_bytes = self._built_from
        self.build(order, solo_bytes=solo_bytes)

    def set_divisor(self, num_ranks: int) -> None:
        """Average over `num_ranks` (join() with divide_by_initial_world_size=False); the built-in hook only."""
        self._divisor, self.inv = num_ranks, _scale(num_ranks)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self.hook is not sum_hook:
            raise UsageError(
                f"{self.tag}register_comm_hook or register_builtin_comm_hook can only be called once. "
                f"A hook {getattr(self.hook, '__name__', self.hook)!r} is already registered on this model; "
                "register a single hook that does all the communication, before the first backward"
            )
        self.hook, self.hook_state, self.prescale = hook, state, False
        self.communicates = True
        self.hook_op = f"comm hook {getattr(hook, '__qualname__', type(hook).__name__)} (gradient bucket)"

    # ---------------------------------------------------------------- copy-in

    def copy_in(self, b: Bucket, pos: int) -> None:
        """Copy parameter `pos` of bucket b into it (any case: None, widened, a user's hook)."""
        grad, view = b.params[pos].grad, b.views[pos]
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            raise GradientError(
                f"{self.tag}parameter {self.names[b.indices[pos]]!r} received a sparse gradient, but it was "
                "not declared sparse when the model was wrapped (only nn.Embedding/nn.EmbeddingBag with "
                "sparse=True are, like torch's DDP); make the layer produce dense gradients"
            )
        elif self.prescale and b.widen:
            view.copy_(grad)
            view.mul_(self.inv)
        elif self.prescale:
            torch.mul(grad, self.inv, out=view)
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)

    def ready_again(self, i: int) -> None:
        """Parameter i's gradient grew after it was ready (several autograd passes)."""
        b, pos = self.where[i]
        if b.future is None:
            if b.eager and self.communicates:
                self.copy_in(b, pos)  # the grad grew since: copy the total again
            return
        raise GradientError(
            f"{self.tag}Expected to mark a variable ready only once. Parameter {self.names[i]!r} received a "
            "gradient again after its bucket was reduced in this backward (it is used in several autograd passes, as with reentrant "
            "activation checkpointing). Pass static_graph=True if the graph is the same every step, or "
            "use torch.utils.checkpoint with use_reentrant=False, and do not combine reentrant "
            "checkpointing with find_unused_parameters=True"
        )

    # ---------------------------------------------------------------- launch

    def launch_completed(self, step: StepState) -> None:
        """Launch the completed buckets that are next in order (buckets launch strictly in order)."""
        while step.next_bucket < len(self.buckets) and self.buckets[step.next_bucket].pending == 0:
            self.launch(step, self.buckets[step.next_bucket])
            step.next_bucket += 1

    def launch(self, step: StepState, b: Bucket) -> None:
        """Hand bucket b (the next in order) to the communication hook, its gradients copied in first."""
        if not self.communicates:
            return
        if b.sparse:
            self._sparse_buffer(b)
        elif b.solo:
            self._solo_buffer(b)
        elif not b.eager:
            grads = [p.grad for p in b.params]
            if any(g is None or g.is_sparse for g in grads):
                for pos in range(len(grads)):
                    self.copy_in(b, pos)
            else:
                foreach_copy_(b.views, grads)  # type: ignore[arg-type]
                if self.prescale:
                    b.buffer.mul_(self.inv)
        step.bytes_sent += b.hook_buffer.numel() * b.hook_buffer.element_size()  # gradient payload
        if b.status is not None and self.hook is sum_hook:
            b.status.fill_(float(step.missing_count))
            b.hook_buffer = b.storage  # type: ignore[assignment]
        elif step.missing_count and b is self.buckets[-1] and self.missing_signal() == "nan":
            b.hook_buffer.view(-1)[-1] = float("nan")  # this step raises everywhere: the value is lost anyway
        b.t_launch = time.perf_counter()
        self.stamp_finished(step.next_bucket, b.t_launch)
        b.t_done = 0.0
        b.record = PROGRESS.issue(self.hook_op, (b.hook_buffer,), self.group)
        b.future = self.call_hook(b)
        b.record.work = b.future

    def call_hook(self, b: Bucket) -> torch.futures.Future[Any]:
        """Hand bucket b (its hook_buffer) to the communication hook; check what comes back."""
        fut = self.hook(self.hook_state, GradBucket(b, len(self.buckets)))
        if not isinstance(fut, FutureBase):
            raise CommHookResultError(
                f"{self.tag}callback must return a torch.futures.Future object, but got "
                f"{type(fut).__module__}.{type(fut).__qualname__}: the communication hook "
                f"{getattr(self.hook, '__name__', self.hook)!r} must return a Future (torch's contract: "
                "hook(state, bucket) -> torch.futures.Future[torch.Tensor])"
            )
        return fut

    def _solo_buffer(self, b: Bucket) -> None:
        # Reduce .grad itself when it can be (contiguous, bucket dtype, no graph); else a temporary copy.
        p = b.params[0]
        grad = p.grad
        if grad is not None and grad.dtype == b.dtype and grad.is_contiguous() and not grad.requires_grad:
            buf = grad
        elif grad is None:
            buf = torch.zeros(p.shape, dtype=b.dtype, device=p.device)
        else:
            buf = grad.to(b.dtype, memory_format=torch.contiguous_format, copy=True)
        if self.prescale:
            buf.mul_(self.inv)
        b.hook_buffer = buf.view(-1)

    def _sparse_buffer(self, b: Bucket) -> None:
        # torch's sparse path: the gradient itself goes to the hook, divided (not multiplied) by the world.
        p = b.params[0]
        grad = p.grad
        if grad is None:
            grad = empty_sparse_grad(p)
        elif not grad.is_sparse:
            raise GradientError(
                f"{self.tag}parameter {self.names[b.indices[0]]!r} is declared sparse (nn.Embedding or "
                "nn.EmbeddingBag with sparse=True) but received a dense gradient on this rank; every rank must "
                "produce the same kind of gradient, like with torch's DDP"
            )
        elif self.prescale:
            grad = grad.div_(self._divisor)
        b.hook_buffer = grad

    def stamp_finished(self, launched: int, now: float) -> None:
        """Record `now` as the end of every launched bucket whose reduction has finished by now.

        Polled at each launch, at the end of backward and after each wait, never by a future callback: a
        Python callback runs in gloo's thread, which must take the GIL from the busy backward before it
        can start the next collective (measured: 3-5% of a step on a model of 800 small parameters).
        """
        for b in self.buckets[:launched]:
            if b.future is not None and not b.t_done and b.future.done():
                b.t_done = now

    def agree_on_unused(self, missing: list[int], used: bytearray, *, learned_static: bool) -> str | None:
        """finalize: an error message (the same on every rank), '' when all is well, None: read the last bucket."""
        return self.unused.agree(
            missing,
            used,
            tolerant=self.settings.find_unused_parameters or self.static_graph,
            learned_static=learned_static,
            signal=self.missing_signal(),
        )

    def read_missing_signal(self, reduced: torch.Tensor, count: int, missing: list[int]) -> str:
        """finalize: the verdict that travelled in the last bucket's reduced value."""
        return self.unused.read(reduced, count, missing, self.missing_signal())

    def shadow(self, used: bytearray, *, learned_static: bool) -> str:
        """join()'s shadow step (shadow.py): every bucket's collective with zeros, the agreement; the verdict."""
        return mirror_backward(
            self.buckets,
            self.call_hook,
            op=self.hook_op + " (join shadow)",
            group=self.group,
            with_status=self.hook is sum_hook,
            agree=lambda: self.agree_on_unused([], used, learned_static=learned_static),
            read_signal=lambda reduced: self.read_missing_signal(reduced, 0, []),
        )

    def missing_signal(self) -> str:
        """How missing gradients reach the other ranks (unused.UnusedAgreement.signal)."""
        tolerant = self.settings.find_unused_parameters or self.static_graph
        return self.unused.signal(tolerant=tolerant, summed=self.hook is sum_hook, last=self.buckets[-1])

    # ---------------------------------------------------------------- wait and write back (finalize)

    def write_back(self) -> None:
        """finalize: each bucket not yet written back is waited for and written back, then reported."""
        as_view, skip, last = (
            self.settings.gradient_as_bucket_view,
            self.unused.globally_unused,
            self.buckets[-1],
        )
        for b in self.buckets:
            if b.future is not None and not b.written:
                write_back_bucket(b, as_view=as_view, skip=skip)
                self.stepper.reduced(b, last=b is last)

    def write_back_one(self, b: Bucket) -> None:
        """During backward: bucket b's all-reduce is done; its averages go into .grad now. Its parameters
        all had a gradient in this backward (optimizer_steps.py defers the others), so none is skipped."""
        write_back_bucket(b, as_view=self.settings.gradient_as_bucket_view, skip=set())

    def record_stats(self, step: StepState, armed: ArmedForward | None, t_end_backward: float) -> None:
        """The step's timings (stats.py): forward, backward, communication and its overlap, finalize."""
        now = time.perf_counter()
        spans = [(b.t_launch, max(b.t_done, b.t_launch)) for b in self.buckets if b.future is not None]
        self.stats.record(
            (armed.t_end - armed.t_start) * 1000.0 if armed and armed.t_start else 0.0,
            (t_end_backward - step.t_backward) * 1000.0,
            union_ms(spans),
            union_ms(spans, until=t_end_backward),
            (now - t_end_backward) * 1000.0,
            step.bytes_sent,
        )


def write_back_bucket(b: Bucket, *, as_view: bool, skip: set[int]) -> None:
    """Wait for launched bucket b and put its averages into `.grad` (`skip`: parameters no rank used)."""
    future = b.future
    if future is None:
        raise InternalError(f"lockstep bug: bucket {b.index} was written back before it was launched")
    b.written = True
    value = wait_tracked(b.record, future) if b.record is not None else future.wait()
    b.t_done = b.t_done or time.perf_counter()
    result = value[0] if isinstance(value, list) else value
    if b.solo:
        _write_back_solo(b, result, skip)
        return
    same = result.data_ptr() == b.buffer.data_ptr() and result.numel() >= b.buffer.numel()
    views = b.views if same else flat_views(result.reshape(-1), b.params)
    grads = [p.grad for p in b.params]
    if (
        not as_view
        and b.same_dtype
        and not (skip and any(i in skip for i in b.indices))
        and not any(map(_IS_NONE, grads))  # in C: no Python frame per parameter
    ):
        foreach_copy_(grads, views)  # type: ignore[arg-type]  # one call for the bucket
        return
    for pos, p in enumerate(b.params):
        if skip and b.indices[pos] in skip:
            continue
        grad, view = p.grad, views[pos]
        if grad is None:
            p.grad = view if as_view and view.dtype == p.dtype else view.to(p.dtype, copy=True)
        elif as_view and view.dtype == p.dtype:
            if grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
                p.grad = view
        else:
            grad.copy_(view)


def _write_back_solo(b: Bucket, result: torch.Tensor, skip: set[int]) -> None:
    p = b.params[0]
    if b.indices[0] in skip:
        return
    if b.sparse:
        p.grad = result
    elif p.grad is None:
        p.grad = result.view(p.shape).to(p.dtype)
    elif result.data_ptr() != p.grad.data_ptr():
        p.grad.copy_(result.view(p.shape))
