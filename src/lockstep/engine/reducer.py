"""The reducer: averages gradients across ranks in buckets, overlapping communication with backward.

Design note. One training step goes through four phases; the same names label the code below.

- pre_forward: (driven by state.py) rebuild the buckets once after the first synced step from rank 0's
  observed ready order (kept as they are, memory and views, when that order gives the same layout: the
  common case). After a synced forward the reducer is *armed* (`ArmedForward`, torch's
  prepare_for_backward): with find_unused_parameters it walks the autograd graph from the outputs to
  find the parameters this rank did not use.
- post_accumulate_grad: a hook per parameter fires once its `.grad` holds this backward's gradient. The
  first one of an armed forward starts the step (`StepState`, step.py); `torch.autograd.grad` calls
  never accumulate into `.grad`, so they never start one (gradient penalties work as with torch).
  Large gradients are copied into their bucket right away (scaled by 1/world on the way, one pass);
  a bucket of many small gradients is copied in one `_foreach_copy_` when it is complete. A gradient of
  4 MiB or more, and every sparse gradient, has a "solo" bucket and is reduced in `.grad` itself (no
  copy in or out, no buffer memory), except with gradient_as_bucket_view for dense ones. The drop-in
  class lays buckets out as torch does instead (SyncPolicy.torch_bucket_layout): no solo buckets.
- launch: a complete bucket goes to the communication hook (torch's contract:
  hook(state, GradBucket) -> Future[Tensor]), strictly in bucket order on every rank: bucket 3 waits
  for bucket 2, or collectives would pair up differently on different ranks.
- finalize: an autograd engine callback at the end of the backward (queued from the outputs' gradient
  hooks, so that it belongs to the outermost backward even under reentrant checkpointing). A pass that
  started no step (an autograd.grad call) leaves the reducer armed. Otherwise parameters without
  gradient are filled in (zeros, or their no_sync-accumulated grads) and their buckets launched, so
  that every rank issues the same collectives; the ranks agree on unused parameters (unused.py), wait,
  and write the averages back into `.grad`.

Fast hooks. A Python hook costs about 2 us a call (measured: 1.75 us for an empty one against 0.5 us
for a C function), which is 3% of a step on a model of 800 small parameters. So after a synced step,
when the buckets are settled (no ready order left to record), every parameter of a bucket of small
gradients (copied in at launch, not by its hook) gets a C hook that appends it to a list, except the
one that completed its bucket in that step: the bucket's trigger keeps the Python hook, which processes
the list in arrival order (`drain`) and so launches the bucket at the same moment as before. If the
order changes, a bucket launches at a later trigger or at finalize (which drains first), and the next
step learns the new trigger: later, never wrong. Not with find_unused_parameters, a static graph or a
model on several devices (hooks on two threads); without find_unused_parameters every parameter gets a
gradient in a synced backward, so every trigger fires and finalize is always queued.

All bucket arithmetic runs under no_grad: with backward(create_graph=True) gradients carry a graph of
their own, which the reduction leaves alone (torch's DDP does not sync higher-order gradients either).
Inside join() (join.py) a rank that ran out of inputs mirrors launch and finalize with zeros
(shadow_backward). join.py uses will_rebuild, maybe_rebuild, set_divisor and shadow_backward, nothing else.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine import unused
from lockstep.engine.bucket_layout import (
    BucketSpec,
    ParamSpec,
    assign_buckets,
    complete_order,
    specs_from_index_lists,
)
from lockstep.engine.bucket_memory import Bucket, GradBucket, empty_sparse_grad, flat_views, sum_hook
from lockstep.engine.policy import SyncPolicy
from lockstep.engine.stats import StatsRecorder, StepStats, union_ms
from lockstep.engine.step import ArmedForward, StepState
from lockstep.errors import CommHookResultError, GradientError, UnusedParameterError, UsageError, rank_tag
from lockstep.runtime.progress import BACKWARD, PROGRESS
from lockstep.runtime.waits import wait_tracked

CommHook = Callable[[Any, "GradBucket"], "torch.futures.Future[Any]"]
# A gradient this large is reduced in place in its own bucket: no copy into a flat buffer and back
# (two passes over memory saved, and the buffer's memory), at the price of one more collective.
SOLO_BUCKET_BYTES = 4 * 1024 * 1024


class Reducer:
    """Buckets and the four phases (see the module docstring); one StepState per backward."""

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
        self.sparse = list(sparse)
        self._n = len(self.params)
        self._tag = rank_tag(rank, world_size)
        self.hook: CommHook = sum_hook
        # Whether buckets go through the hook. A world of one skips the built-in sum (nothing to add) but,
        # like torch's DDP, still hands buckets to a user's hook: fp16 compression changes the bits.
        self._communicates = world_size > 1
        self._hook_op = "allreduce (gradient bucket)"  # how the hang watchdog names a bucket's collective
        self.hook_state: Any = group
        self._prescale = True
        self._divisor = world_size
        self._inv = 1.0 / world_size
        self.static_graph = policy.static_graph
        self.stats = StatsRecorder()
        self.rebuilt = False
        # ready order of the first synced step, for the rebuild; torch never rebuilds with find_unused_parameters
        self._order: list[int] | None = None if self._torch_skips_rebuild() else []
        self._order_complete = False
        self._static_hits: list[int] | None = None  # learned by static_graph in its first step
        self._static_unused: list[int] = []
        self._globally_unused: set[int] = set()
        self._used = bytearray(self._n)  # parameters used since the last synced step (no_sync included)
        self._armed: ArmedForward | None = None
        self._step: StepState | None = None
        self._queued = False
        self._specs: list[ParamSpec] | None = None
        self._layout: list[BucketSpec] | None = None
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._handles: list[Any] = []  # one hook handle per parameter (attach_hooks)
        self._fast = bytearray(self._n)  # 1: parameter i's hook is the fast one
        self._arrivals: list[torch.Tensor] = []  # what fast hooks reported, not yet drained
        self._record_arrival = functools.partial(list.append, self._arrivals)  # a C call: no Python frame
        self._single_device = len({p.device for p in self.params}) <= 1
        self._t_output_grad = 0.0  # when this backward reached the outputs
        self._build(None)
        self.initial_layout: list[BucketSpec] = list(self._layout or [])

    # ---------------------------------------------------------------- layout

    @property
    def layout(self) -> list[BucketSpec]:
        """The buckets now, in launch order."""
        return list(self._layout or [])

    def _build(self, order: Sequence[int] | None) -> None:
        if self._specs is None:  # parameters never change: describe them once
            self._specs = [
                ParamSpec(
                    name,
                    p.numel(),
                    p.numel() * self._bucket_dtype(p).itemsize,
                    str(p.device),
                    str(p.dtype),
                    sparse=sparse,
                )
                for name, p, sparse in zip(self.names, self.params, self.sparse)
            ]
        if self.policy.torch_bucket_layout:
            layout = specs_from_index_lists(self._specs, self._torch_index_lists(order))
        else:
            layout = assign_buckets(
                self._specs,
                cap_bytes=self.policy.bucket_cap_bytes,
                first_cap_bytes=self.policy.first_bucket_bytes,
                order=order,
                solo_bytes=None if self.policy.gradient_as_bucket_view else SOLO_BUCKET_BYTES,
            )
        if layout == self._layout:  # the observed order gives the same buckets: keep their memory and views
            return
        self._layout = layout
        status = not self.policy.torch_bucket_layout  # torch's layout has no room for the status element
        self.buckets = [
            Bucket(
                s,
                self.params,
                self._bucket_dtype(self.params[s.param_indices[0]]),
                status and s.index == len(layout) - 1,
            )
            for s in layout
        ]
        self._where: list[tuple[Bucket, int]] = [None] * self._n  # type: ignore[list-item]
        for b in self.buckets:
            for pos, i in enumerate(b.indices):
                self._where[i] = (b, pos)

    def _torch_index_lists(self, order: Sequence[int] | None) -> list[list[int]]:
        """torch's buckets, from torch's own assignment function, as DistributedDataParallel calls it."""
        first, cap = self.policy.first_bucket_bytes, self.policy.bucket_cap_bytes
        assign = dist._compute_bucket_assignment_by_size
        tensors: list[torch.Tensor] = list(self.params)
        if order is None:  # construction: all in one bucket unless unused parameters are searched for
            one_bucket = self.static_graph or not self.policy.find_unused_parameters
            limits = [sys.maxsize] if one_bucket else [first, cap] if first < cap else [cap]
            lists, _ = assign(tensors, limits, self.sparse)
            return list(reversed(lists))  # launch order: the last parameters' gradients come first
        lists, _ = assign([tensors[i] for i in order], [first, cap], self.sparse, list(order))
        return lists  # the rebuild: already in ready order

    def _torch_skips_rebuild(self) -> bool:
        return (
            self.policy.torch_bucket_layout and self.policy.find_unused_parameters and not self.static_graph
        )

    def _bucket_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.policy.bucket_dtype(p.dtype)

    def set_divisor(self, num_ranks: int) -> None:
        """Average over `num_ranks` (join() with divide_by_initial_world_size=False); the built-in hook only."""
        self._divisor, self._inv = num_ranks, 1.0 / num_ranks

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self.hook is not sum_hook:
            raise UsageError(
                f"{self._tag}register_comm_hook or register_builtin_comm_hook can only be called once. "
                f"A hook {getattr(self.hook, '__name__', self.hook)!r} is already registered on this model; "
                "register a single hook that does all the communication, before the first backward"
            )
        self.hook, self.hook_state, self._prescale = hook, state, False
        self._communicates = True
        self._hook_op = f"comm hook {getattr(hook, '__qualname__', type(hook).__name__)} (gradient bucket)"

    def enable_static_graph(self) -> None:
        """torch's _set_static_graph(): before the first backward, like static_graph=True."""
        self.static_graph = True
        if self._order is None and not self.rebuilt:
            self._order = []  # torch rebuilds under a static graph, find_unused_parameters or not

    # ---------------------------------------------------------------- pre_forward

    def will_rebuild(self) -> bool:
        """True when the next synced pre_forward rebuilds the buckets (once, after the first synced step)."""
        return self._order is not None and self._order_complete

    def maybe_rebuild(self, *, force: bool = False) -> None:
        """pre_forward, once after the first synced step: every rank adopts rank 0's ready order.

        `force`: a rank that ran out of inputs inside join() joins the others' rebuild (its own order may
        be incomplete; rank 0's is what counts, and it sends what it saw).
        """
        if not force and (self._order is None or not self._order_complete):
            return
        from lockstep.runtime.collectives import broadcast_object

        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        order = broadcast_object(complete_order(self._order or [], self._n), src=src, group=self.group)
        self._order = None
        self._build(order)
        self.rebuilt = True

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor], t_forward_start: float) -> None:
        """Arm for the backward of this forward (the last synced forward wins, like torch)."""
        self.drain()  # pre_forward drained too; this catches a backward run inside the forward itself
        if self._static_hits is not None:
            forward_unused = self._static_unused
        elif self.policy.find_unused_parameters and not self.static_graph:
            forward_unused = unused.unreached(outputs, self._index_of)
        else:
            forward_unused = []
        self._armed = ArmedForward(forward_unused, t_forward_start)
        self._step = None
        self._t_output_grad = 0.0
        for t in outputs:
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # Queued from an output's gradient, the callback belongs to the outermost backward, even when
        # reentrant checkpointing runs nested backwards that fire parameter hooks.
        if self._armed is not None and not self._queued:
            self._queue_finalize()
            if self._step is None:  # the backward starts here (a fast hook may be the first to fire)
                self._t_output_grad = time.perf_counter()
                PROGRESS.set_phase(BACKWARD)

    def _queue_finalize(self) -> None:
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.finalize)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- post_accumulate_grad

    def attach_hooks(self) -> None:
        """Register a hook per parameter (the Python one: fast hooks are chosen after a synced step)."""
        self._handles = [self._register_hook(i, fast=False) for i in range(self._n)]
        self._fast = bytearray(self._n)

    def detach_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._fast = bytearray(self._n)
        self._arrivals.clear()

    def _register_hook(self, i: int, *, fast: bool) -> Any:
        hook = self._record_arrival if fast else functools.partial(self.post_accumulate_grad, i)
        return self.params[i].register_post_accumulate_grad_hook(hook)

    def post_accumulate_grad(self, i: int, _param: torch.Tensor | None = None) -> None:
        """The per-parameter Python hook: param i's .grad is complete for this backward.

        Registered as `functools.partial(post_accumulate_grad, i)`. Parameters reported by a fast hook
        before this one are processed first, in their order.
        """
        if self._arrivals:
            self.drain()
        self._arrived(i)

    def drain(self) -> None:
        """Process the parameters that fast hooks reported since the last drain, in arrival order."""
        arrivals = self._arrivals
        n = len(arrivals)
        if not n:
            return
        batch = arrivals[:n]
        del arrivals[:n]
        index_of = self._index_of
        with torch.no_grad():
            if self._armed is not None and self._order is None:
                self._drain_ready(batch)
                return
            for p in batch:
                self._arrived(index_of[id(p)])

    def _drain_ready(self, batch: list[torch.Tensor]) -> None:
        """drain() for a synced step whose bucket order is settled: `_arrived` inlined for parameters
        of copy-at-launch buckets ready for the first time (0.4 us each instead of 1; the fast hooks
        are on such parameters only). Any other arrival takes the general path, in its turn."""
        step = self._step or self._start_step()
        if step.hits is not None:
            for p in batch:
                self._arrived(self._index_of[id(p)])
            return
        index_of, where, used, ready = self._index_of, self._where, self._used, step.ready
        for p in batch:
            i = index_of[id(p)]
            b = where[i][0]
            if ready[i] or b.eager:
                self._arrived(i)
                continue
            used[i] = ready[i] = 1
            b.pending -= 1
            if b.pending == 0:
                b.last_ready = i
                if not step.defer:
                    self._launch_completed(step)

    def _arrived(self, i: int) -> None:
        """Param i's gradient is complete (the common case, a step under way and first time ready, in
        the fewest Python calls: this runs once per parameter and backward)."""
        self._used[i] = 1
        if self._armed is None:
            return  # no_sync, eval, or a backward that did not follow a synced forward: accumulate locally
        step = self._step
        if step is not None and step.hits is None and not step.ready[i] and not torch.is_grad_enabled():
            self._mark_ready(step, i)
            return
        if torch.is_grad_enabled():  # backward(create_graph=True): keep the reduction out of the graph
            with torch.no_grad():
                self._accumulated(i)
        else:
            self._accumulated(i)

    def _accumulated(self, i: int) -> None:
        step = self._step or self._start_step()
        if step.hits is not None:
            step.hits[i] += 1
            if self._static_hits is not None and step.hits[i] < self._static_hits[i]:
                return
        if step.ready[i]:
            self._ready_again(i)
            return
        self._mark_ready(step, i)

    def _start_step(self) -> StepState:
        step = self._step = StepState(self._n, count_hits=self.static_graph, defer=self._first_static)
        if self._t_output_grad:
            step.t_backward, self._t_output_grad = self._t_output_grad, 0.0
        PROGRESS.set_phase(BACKWARD)
        for b in self.buckets:
            b.pending, b.future, b.hook_buffer = len(b.params), None, b.buffer
        if not self._queued:
            self._queue_finalize()
        for i in self._armed.unused if self._armed is not None else ():
            self._mark_ready(step, i)
        return step

    def _mark_ready(self, step: StepState, i: int) -> None:
        step.ready[i] = 1
        if self._order is not None:
            self._order.append(i)
        b, pos = self._where[i]
        if b.eager and self._communicates:
            self._copy_in_one(b, pos)
        b.pending -= 1
        if b.pending == 0:
            b.last_ready = i
        if b.pending == 0 and not step.defer:
            self._launch_completed(step)

    def _launch_completed(self, step: StepState) -> None:
        """Launch the completed buckets that are next in order (buckets launch strictly in order)."""
        while step.next_bucket < len(self.buckets) and self.buckets[step.next_bucket].pending == 0:
            self._launch(step, self.buckets[step.next_bucket])
            step.next_bucket += 1

    @property
    def _first_static(self) -> bool:
        # static_graph's first step reduces at the end: how often each parameter fires is not known yet.
        return self.static_graph and self._static_hits is None

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
        b, pos = self._where[i]
        if b.future is None:
            if b.eager and self._communicates:
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

    def _launch(self, step: StepState, b: Bucket) -> None:
        if not self._communicates:
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

    # ---------------------------------------------------------------- finalize

    def finalize(self) -> None:
        """End of backward: fill in, launch the rest, agree on unused parameters, wait, write back."""
        self._queued = False
        self.drain()
        step = self._step
        if step is None:
            return  # a pass that accumulated no gradient (autograd.grad): stay armed for the real backward
        with torch.no_grad():
            verdict = self._finalize(step)
        if verdict:
            raise UnusedParameterError(verdict)

    def _stamp_finished(self, launched: int, now: float) -> None:
        """Record `now` as the end of every launched bucket whose reduction has finished by now.

        Polled at each launch, at the end of backward and after each wait, never by a future callback: a
        Python callback runs in gloo's thread, which must take the GIL from the busy backward before it
        can start the next collective (measured: 3-5% of a step on a model of 800 small parameters).
        """
        for b in self.buckets[:launched]:
            if b.future is not None and not b.t_done and b.future.done():
                b.t_done = now

    def _finalize(self, step: StepState) -> str:
        t_end_backward = time.perf_counter()
        self._stamp_finished(step.next_bucket, t_end_backward)
        missing = step.missing()
        step.missing_count = len(missing)
        step.defer = False
        for i in missing:
            self._mark_ready(step, i)  # zeros or no_sync-accumulated grads: every rank launches every bucket
        while step.next_bucket < len(self.buckets):
            self._launch(step, self.buckets[step.next_bucket])
            step.next_bucket += 1
        verdict = self._agree_on_unused(missing)
        self._write_back()
        if verdict is None:  # the signal travelled in the last bucket
            verdict = self._read_missing_signal(self.buckets[-1].hook_buffer, len(missing), missing)
        self._finish_step(step, t_end_backward, missing)
        return verdict

    def _missing_signal(self) -> str:
        """How parameters without gradient reach the other ranks when they are an error (no
        find_unused_parameters, no static graph), without a collective of its own in the common case:

        - "status": lockstep's layout gives the last bucket an extra element, each rank's count, summed;
        - "nan": torch's layout has no room for it (an extra element would move gloo's ring chunks and
          change the sums' bits at world >= 3), so a rank with missing gradients writes NaN over the last
          bucket's last element. A sum that comes back NaN (a real NaN gradient, or a flag) is settled by
          a count all-reduce on every rank: the sum is the same everywhere, so all ranks take that path;
        - "count": a comm hook of the user's owns the bucket (it may not sum): an 8-byte all-reduce;
        - "tolerated": find_unused_parameters or a static graph: missing gradients are no error.
        """
        if self.policy.find_unused_parameters or self.static_graph:
            return "tolerated"
        if self.hook is not sum_hook:
            return "count"
        last = self.buckets[-1]
        if last.status is not None:
            return "status"
        return "nan" if not last.sparse and last.nbytes and last.dtype.is_floating_point else "count"

    def _read_missing_signal(self, reduced: torch.Tensor, count: int, missing: list[int]) -> str:
        """The error message (or '') from the last bucket's reduced buffer, as `_missing_signal` put it."""
        if self._missing_signal() == "status":
            total = int(reduced.reshape(-1)[-1].item())
        elif bool(torch.isnan(reduced.reshape(-1)[-1])):
            total = unused.total_missing(count, self.group, self.device)
        else:
            total = 0
        return unused.name_missing(self.names, missing, self._tag, self.group) if total else ""

    def _agree_on_unused(self, missing: list[int]) -> str | None:
        """An error message (the same on every rank), '' when all is well, None: read the last bucket."""
        tolerant = self.policy.find_unused_parameters or self.static_graph
        if self.world == 1:
            # Used since the last synced step, as the bitmap all-reduce gives at any other world size.
            self._globally_unused = {i for i in range(self._n) if not self._used[i]} if tolerant else set()
            if tolerant or not missing:
                return ""
            return unused.missing_message(self._tag, {0: [self.names[i] for i in missing]})
        if self._static_hits is not None:
            return ""  # learned in the first step: the graph does not change
        if tolerant:
            self._globally_unused = unused.globally_unused(self._used, self.group, self.device)
            return ""
        if self._missing_signal() in ("status", "nan"):
            return None
        total = unused.total_missing(len(missing), self.group, self.device)
        return unused.name_missing(self.names, missing, self._tag, self.group) if total else ""

    def _write_back(self) -> None:
        as_view = self.policy.gradient_as_bucket_view
        skip = self._globally_unused
        for b in self.buckets:
            if b.future is None:
                continue
            value = wait_tracked(b.record, b.future) if b.record is not None else b.future.wait()
            b.t_done = b.t_done or time.perf_counter()
            result = value[0] if isinstance(value, list) else value
            if b.solo:
                self._write_back_solo(b, result)
                continue
            same = result.data_ptr() == b.buffer.data_ptr() and result.numel() >= b.buffer.numel()
            views = b.views if same else flat_views(result.reshape(-1), b.params)
            grads = [p.grad for p in b.params]
            if (
                not as_view
                and not (skip and any(i in skip for i in b.indices))
                and all(g is not None and g.dtype == v.dtype for g, v in zip(grads, views))
            ):
                torch._foreach_copy_(grads, views)  # type: ignore[arg-type]  # one call for the bucket
                continue
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

    def _write_back_solo(self, b: Bucket, result: torch.Tensor) -> None:
        p = b.params[0]
        if b.indices[0] in self._globally_unused:
            return
        if b.sparse:
            p.grad = result
        elif p.grad is None:
            p.grad = result.view(p.shape).to(p.dtype)
        elif result.data_ptr() != p.grad.data_ptr():
            p.grad.copy_(result.view(p.shape))

    def _finish_step(self, step: StepState, t_end_backward: float, missing: list[int]) -> None:
        learned_static = self._first_static
        if learned_static:
            self._static_hits = [max(h, 1) for h in step.hits or [0] * self._n]
            self._static_unused = list(missing)
        armed = self._armed
        now = time.perf_counter()
        spans = [(b.t_launch, max(b.t_done, b.t_launch)) for b in self.buckets if b.future is not None]
        self.stats.record(
            StepStats(
                step=self.stats.steps + 1,
                forward_ms=(armed.t_end - armed.t_start) * 1000.0 if armed and armed.t_start else 0.0,
                backward_ms=(t_end_backward - step.t_backward) * 1000.0,
                comm_ms=union_ms(spans),
                comm_hidden_ms=union_ms(spans, until=t_end_backward),
                finalize_ms=(now - t_end_backward) * 1000.0,
                bytes_communicated=step.bytes_sent,
            )
        )
        self._armed = self._step = None
        self._used = bytearray(self._n)
        self._choose_hooks()
        PROGRESS.end_step()
        if learned_static and self.policy.torch_bucket_layout and self._order is not None:
            self._order = []  # torch observes the ready order in the second step of a static graph
        else:
            self._order_complete = self._order is not None

    def _choose_hooks(self) -> None:
        """Fast hooks where they are safe, Python hooks elsewhere (see "Fast hooks" in the module doc)."""
        if not self._handles:
            return
        want = bytearray(self._n)
        if (
            self._communicates
            and self._order is None
            and not self.static_graph
            and not self.policy.find_unused_parameters
            and self._single_device
        ):
            for b in self.buckets:
                if b.eager or b.solo or b.sparse or b.last_ready < 0:
                    continue
                for i in b.indices:
                    want[i] = 1
                want[b.last_ready] = 0  # the bucket's trigger: its Python hook drains and launches it
        if want == self._fast:
            return
        for i in range(self._n):
            if want[i] != self._fast[i]:
                self._handles[i].remove()
                self._handles[i] = self._register_hook(i, fast=bool(want[i]))
        self._fast = want

    # ---------------------------------------------------------------- join's shadow step (join.py)

    def shadow_backward(self) -> None:
        """The collectives of a synced backward, with zeros, on a rank that ran out of inputs (join()).

        The mirror of launch + finalize on a training rank, in the same order: every bucket through the
        communication hook (same sizes and dtypes, the status element included), then the unused-parameter
        agreement, and if a training rank lacks gradients, the same UnusedParameterError here too.
        """
        if self.world == 1:
            return
        launched = []
        for b in self.buckets:
            b.hook_buffer = self._shadow_buffer(b)
            record = PROGRESS.issue(self._hook_op + " (join shadow)", (b.hook_buffer,), self.group)
            record.work = self._call_hook(b)
            launched.append(record)
        self._used = bytearray(self._n)  # this rank used nothing in the step it shadows
        verdict = self._agree_on_unused([])
        values = [wait_tracked(record, record.work) for record in launched]
        for b in self.buckets:
            b.hook_buffer = b.buffer
        if verdict is None:  # the training ranks' signal travelled in the last bucket
            last = values[-1][0] if isinstance(values[-1], list) else values[-1]
            verdict = self._read_missing_signal(last, 0, [])
        if self._first_static:  # the training ranks learned their pattern in the step shadowed here
            self._static_hits, self._static_unused = [1] * self._n, []
        if verdict:
            raise UnusedParameterError(verdict)

    def _shadow_buffer(self, b: Bucket) -> torch.Tensor:
        """Zeros shaped as what a training rank hands the hook for bucket b (see _launch)."""
        p = b.params[0]
        if b.sparse:
            return empty_sparse_grad(p)
        if b.solo:
            return torch.zeros(p.numel(), dtype=b.dtype, device=p.device)
        zeros = torch.zeros_like(b.storage)  # type: ignore[arg-type]  # only solo buckets have none
        return zeros if b.status is not None and self.hook is sum_hook else zeros[: b.buffer.numel()]
