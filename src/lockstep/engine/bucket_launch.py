"""A reducer's buckets from copy-in to write-back: filled, handed to the communication hook in order, waited.

The launch phase of reducer.py's design note, and the waits at the end of finalize. Gradients reach a
bucket's flat buffer scaled by 1/world on the way (one pass) when the built-in hook sums: an eager
bucket (large gradients) is copied into by each parameter's hook (`_copy_in_one`), any other in one
`_foreach_copy_` at launch. A solo bucket hands `.grad` itself to the hook (or a copy when its dtype
or memory layout differ); a sparse one its sparse gradient, divided (not multiplied) by the world as
torch does. A complete bucket goes to the communication hook (torch's contract:
hook(state, GradBucket) -> Future[Tensor]) strictly in bucket order on every rank: bucket 3 waits for
bucket 2, or collectives would pair up differently on different ranks. After the waits,
`write_back_bucket` copies each result into `.grad` (one `_foreach_copy_` per bucket where it can), or makes `.grad` a view
of the bucket (gradient_as_bucket_view).

`BucketLauncher` holds this and the communication hook's settings; the reducer (reducer.py) is a
BucketLauncher that adds the step's phases. A base class rather than a member: `_copy_in_one` and the
settings it reads run once per parameter of an eager bucket, where one more attribute lookup would
show.
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.bucket_layout import BucketSpec
from lockstep.engine.bucket_memory import (
    Bucket,
    GradBucket,
    build_buckets,
    empty_sparse_grad,
    flat_views,
    sum_hook,
)
from lockstep.engine.bucket_plan import BucketPlanner
from lockstep.engine.optimizer_steps import OptimizerSteps, PlainSteps
from lockstep.engine.policy import SyncPolicy
from lockstep.engine.stats import StatsRecorder, union_ms
from lockstep.engine.step import ArmedForward, StepState
from lockstep.engine.unused import UnusedAgreement
from lockstep.errors import CommHookResultError, GradientError, InternalError, UsageError, rank_tag
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import wait_tracked

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
        policy: SyncPolicy,
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        world_size: int,
        sparse: Sequence[bool],
        device: torch.device,
    ) -> None:
        self.params, self.names, self.policy, self.group = list(params), list(names), policy, group
        self.rank, self.world, self.device = rank, world_size, device
        self._n = len(self.params)
        self._tag = rank_tag(rank, world_size)
        self.hook: CommHook = sum_hook
        # Whether buckets go through the hook. A world of one skips the built-in sum (nothing to add) but,
        # like torch's DDP, still hands buckets to a user's hook: fp16 compression changes the bits.
        self.communicates = world_size > 1
        self._hook_op = "allreduce (gradient bucket)"  # how the hang watchdog names a bucket's collective
        self.hook_state: Any = group
        self._prescale = True
        self._divisor = world_size
        self._inv = _scale(world_size)
        self.static_graph = policy.static_graph
        self.stats = StatsRecorder()
        self._planner = BucketPlanner(self.params, self.names, sparse, policy)
        self._layout: list[BucketSpec] | None = None
        # the last _build's order and solo size: relayout builds again from them at another cap
        self._built_from: tuple[Sequence[int] | None, int | None] = (None, None)
        self.buckets: list[Bucket] = []
        self.where: list[tuple[Bucket, int]] = []  # per parameter: its bucket and its position there
        self._unused = UnusedAgreement(self.names, self._tag, group, device, world_size)
        # who steps the optimizer: the user after backward (plain), or each bucket once back (overlapped)
        self.optimizer_steps: OptimizerSteps = PlainSteps()

    @property
    def layout(self) -> list[BucketSpec]:
        """The buckets now, in launch order."""
        return list(self._layout or [])

    def _build(self, order: Sequence[int] | None, *, solo_bytes: int | None) -> None:
        self._built_from = (order, solo_bytes)
        layout = self._planner.layout(order, static_graph=self.static_graph, solo_bytes=solo_bytes)
        if layout == self._layout:  # the observed order gives the same buckets: keep their memory and views
            return
        self._layout = layout
        status = not self.policy.torch_bucket_layout  # torch's layout has no room for the status element
        # the old buckets' memory goes before the new is allocated: a rebuild never holds both (+1 model's
        # worth of gradients at the peak otherwise)
        for b in self.buckets:
            b.release()
        self.buckets, self.where = [], []
        self._buckets_dropped()
        self.buckets, self.where = build_buckets(layout, self.params, self._planner.dtypes, status=status)

    def _buckets_dropped(self) -> None:
        """The buckets are about to be built again: drop every other reference to the old ones."""

    def layout_at(self, cap_bytes: int) -> list[BucketSpec]:
        """bucket_tuner.py: the buckets the last build's order gives at `cap_bytes`, not built."""
        order, solo_bytes = self._built_from
        return self._planner.layout(
            order, static_graph=self.static_graph, solo_bytes=solo_bytes, cap_bytes=cap_bytes
        )

    def relayout(self, cap_bytes: int) -> None:
        """bucket_tuner.py, between steps: the buckets built again at `cap_bytes`, in the last build's order."""
        self._planner.cap_bytes = cap_bytes
        order, solo_bytes = self._built_from
        self._build(order, solo_bytes=solo_bytes)

    def set_divisor(self, num_ranks: int) -> None:
        """Average over `num_ranks` (join() with divide_by_initial_world_size=False); the built-in hook only."""
        self._divisor, self._inv = num_ranks, _scale(num_ranks)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self.hook is not sum_hook:
            raise UsageError(
                f"{self._tag}register_comm_hook or register_builtin_comm_hook can only be called once. "
                f"A hook {getattr(self.hook, '__name__', self.hook)!r} is already registered on this model; "
                "register a single hook that does all the communication, before the first backward"
            )
        self.hook, self.hook_state, self._prescale = hook, state, False
        self.communicates = True
        self._hook_op = f"comm hook {getattr(hook, '__qualname__', type(hook).__name__)} (gradient bucket)"

    # ---------------------------------------------------------------- copy-in

    def _copy_in_one(self, b: Bucket, pos: int) -> None:
        grad, view = b.params[pos].grad, b.views[pos]
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            raise GradientError(
                f"{self._tag}parameter {self.names[b.indices[pos]]!r} received a sparse gradient, but it was "
                "not declared sparse when the model was wrapped (only nn.Embedding/nn.EmbeddingBag with "
                "sparse=True are, like torch's DDP); make the layer produce dense gradients"
            )
        elif self._prescale and b.widen:
            view.copy_(grad)
            view.mul_(self._inv)
        elif self._prescale:
            torch.mul(grad, self._inv, out=view)
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)

    def _ready_again(self, i: int) -> None:
        b, pos = self.where[i]
        if b.future is None:
            if b.eager and self.communicates:
                self._copy_in_one(b, pos)  # the grad grew since: copy the total again
            return
        raise GradientError(
            f"{self._tag}Expected to mark a variable ready only once. Parameter {self.names[i]!r} received a "
            "gradient again after its bucket was reduced in this backward (it is used in several autograd passes, as with reentrant "
            "activation checkpointing). Pass static_graph=True if the graph is the same every step, or "
            "use torch.utils.checkpoint with use_reentrant=False, and do not combine reentrant "
            "checkpointing with find_unused_parameters=True"
        )

    # ---------------------------------------------------------------- launch

    def launch_completed(self, step: StepState) -> None:
        """Launch the completed buckets that are next in order (buckets launch strictly in order)."""
        while step.next_bucket < len(self.buckets) and self.buckets[step.next_bucket].pending == 0:
            self._launch(step, self.buckets[step.next_bucket])
            step.next_bucket += 1

    def _launch(self, step: StepState, b: Bucket) -> None:
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
                    self._copy_in_one(b, pos)
            else:
                torch._foreach_copy_(b.views, grads)  # type: ignore[arg-type]
                if self._prescale:
                    b.buffer.mul_(self._inv)
        step.bytes_sent += b.hook_buffer.numel() * b.hook_buffer.element_size()  # gradient payload
        if b.status is not None and self.hook is sum_hook:
            b.status.fill_(float(step.missing_count))
            b.hook_buffer = b.storage  # type: ignore[assignment]
        elif step.missing_count and b is self.buckets[-1] and self._missing_signal() == "nan":
            b.hook_buffer.view(-1)[-1] = float("nan")  # this step raises everywhere: the value is lost anyway
        b.t_launch = time.perf_counter()
        self._stamp_finished(step.next_bucket, b.t_launch)
        b.t_done = 0.0
        b.record = PROGRESS.issue(self._hook_op, (b.hook_buffer,), self.group)
        b.future = self._call_hook(b)
        b.record.work = b.future

    def _call_hook(self, b: Bucket) -> torch.futures.Future[Any]:
        """Hand bucket b (its hook_buffer) to the communication hook; check what comes back."""
        fut = self.hook(self.hook_state, GradBucket(b, len(self.buckets)))
        if not isinstance(fut, torch._C.Future):
            raise CommHookResultError(
                f"{self._tag}callback must return a torch.futures.Future object, but got "
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
        if self._prescale:
            buf.mul_(self._inv)
        b.hook_buffer = buf.view(-1)

    def _sparse_buffer(self, b: Bucket) -> None:
        # torch's sparse path: the gradient itself goes to the hook, divided (not multiplied) by the world.
        p = b.params[0]
        grad = p.grad
        if grad is None:
            grad = empty_sparse_grad(p)
        elif not grad.is_sparse:
            raise GradientError(
                f"{self._tag}parameter {self.names[b.indices[0]]!r} is declared sparse (nn.Embedding or "
                "nn.EmbeddingBag with sparse=True) but received a dense gradient on this rank; every rank must "
                "produce the same kind of gradient, like with torch's DDP"
            )
        elif self._prescale:
            grad = grad.div_(self._divisor)
        b.hook_buffer = grad

    def _stamp_finished(self, launched: int, now: float) -> None:
        """Record `now` as the end of every launched bucket whose reduction has finished by now.

        Polled at each launch, at the end of backward and after each wait, never by a future callback: a
        Python callback runs in gloo's thread, which must take the GIL from the busy backward before it
        can start the next collective (measured: 3-5% of a step on a model of 800 small parameters).
        """
        for b in self.buckets[:launched]:
            if b.future is not None and not b.t_done and b.future.done():
                b.t_done = now

    def _missing_signal(self) -> str:
        """How missing gradients reach the other ranks (unused.UnusedAgreement.signal)."""
        tolerant = self.policy.find_unused_parameters or self.static_graph
        return self._unused.signal(tolerant=tolerant, summed=self.hook is sum_hook, last=self.buckets[-1])

    # ---------------------------------------------------------------- wait and write back (finalize)

    def _write_back(self) -> None:
        """finalize: each bucket not yet written back is waited for and written back, then reported."""
        as_view, skip, last = (
            self.policy.gradient_as_bucket_view,
            self._unused.globally_unused,
            self.buckets[-1],
        )
        for b in self.buckets:
            if b.future is not None and not b.written:
                write_back_bucket(b, as_view=as_view, skip=skip)
                self.optimizer_steps.reduced(b, last=b is last)

    def _write_back_one(self, b: Bucket) -> None:
        """During backward: bucket b's all-reduce is done; its averages go into .grad now. Its parameters
        all had a gradient in this backward (optimizer_steps.py defers the others), so none is skipped."""
        write_back_bucket(b, as_view=self.policy.gradient_as_bucket_view, skip=set())

    def _record_stats(self, step: StepState, armed: ArmedForward | None, t_end_backward: float) -> None:
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
        torch._foreach_copy_(grads, views)  # type: ignore[arg-type]  # one call for the bucket
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
