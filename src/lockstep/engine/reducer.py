"""The reducer: averages gradients across ranks in buckets, overlapping communication with backward.

Design note. One training step goes through four phases; the same names label the code below.

- pre_forward: (between forward and backward, driven by state.py) reset the per-step bookkeeping;
  rebuild the buckets once after the first synced step from rank 0's observed ready order (kept as
  they are, memory and views, when that order gives the same layout: the common case); with
  find_unused_parameters, walk the autograd graph from the outputs to find the parameters this rank
  did not use.
- post_accumulate_grad: a hook per parameter fires once its `.grad` holds this step's full gradient.
  Large gradients are copied into their bucket right away (scaled by 1/world on the way, one pass);
  a bucket of many small gradients is copied in one `_foreach_copy_` when it is complete, which keeps
  the per-hook Python work to a few operations. A gradient of 4 MiB or more has a "solo" bucket and
  is reduced in place in `.grad` (no copy in, no copy out, no buffer memory), except with
  gradient_as_bucket_view, whose contract is that grads are views of the flat buckets.
- launch: a complete bucket goes to the communication hook (torch's contract:
  hook(state, GradBucket) -> Future[Tensor]), strictly in bucket order on every rank: bucket 3 waits
  for bucket 2, or collectives would pair up differently on different ranks.
- finalize: an autograd engine callback at the end of backward. Parameters that got no gradient are
  filled in (zeros, or their no_sync-accumulated grads) and their buckets launched, so that every rank
  issues the same collectives whatever happened, and nothing hangs. Every rank's count of such
  parameters rides in one extra element of the last bucket, so all ranks learn of a problem without an
  extra collective and raise the same error naming the parameters and ranks (with a user comm hook, or
  with find_unused_parameters' bitmap, a small separate all-reduce does it). Then wait, and write the
  averages back into `.grad` (one `_foreach_copy_` per bucket, or views with gradient_as_bucket_view).

Inside join() (protocol in join.py) a rank that ran out of inputs mirrors launch and finalize with zero
buckets (`shadow_backward`), so that the training ranks' collectives always find a partner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.bucketing import BucketSpec, ParamSpec, assign_buckets, complete_order
from lockstep.engine.buckets import Bucket, GradBucket, flat_views, sum_hook
from lockstep.engine.policy import SyncPolicy
from lockstep.engine.stats import StatsRecorder, StepStats, union_ms
from lockstep.errors import UnusedParameterError, rank_tag
from lockstep.runtime.collectives import all_gather_object

CommHook = Callable[[Any, "GradBucket"], "torch.futures.Future[Any]"]
# A gradient this large is reduced in place in its own bucket: no copy into a flat buffer and back
# (two passes over memory saved, and the buffer's memory), at the price of one more collective.
SOLO_BUCKET_BYTES = 4 * 1024 * 1024


class Reducer:
    """Buckets, per-step readiness and the four phases (see the module docstring)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        policy: SyncPolicy,
        group: dist.ProcessGroup | None,
        *,
        rank: int,
        world_size: int,
    ) -> None:
        self.params, self.names, self.policy, self.group = list(params), list(names), policy, group
        self.rank, self.world = rank, world_size
        self._n = len(self.params)
        self._tag = rank_tag(rank, world_size)
        self._hook: CommHook = sum_hook
        self._hook_state: Any = group
        self._prescale = True
        self._inv = 1.0 / world_size
        self.stats = StatsRecorder()
        self.rebuilt = False
        self._order: list[int] | None = []  # ready order of the first synced step, for the rebuild
        self._order_complete = False
        self._static_hits: list[int] | None = None  # learned by static_graph in its first step
        self._static_unused: list[int] = []
        self._unused_now: list[int] = []  # this step's unused parameters (indices); reset per step
        self._globally_unused: set[int] = set()
        self._used = bytearray(self._n)
        self._expect = False
        self._specs: list[ParamSpec] | None = None
        self._layout: list[BucketSpec] | None = None
        self._build(None)
        self._reset_step()

    # ---------------------------------------------------------------- layout

    def _build(self, order: Sequence[int] | None) -> None:
        if self._specs is None:  # parameters never change: describe them once
            self._specs = [
                ParamSpec(name, p.numel(), p.numel() * self._bucket_dtype(p).itemsize, str(p.device), str(p.dtype))
                for name, p in zip(self.names, self.params)
            ]
        layout = assign_buckets(
            self._specs, cap_bytes=self.policy.bucket_cap_bytes, first_cap_bytes=self.policy.first_bucket_bytes,
            order=order, solo_bytes=None if self.policy.gradient_as_bucket_view else SOLO_BUCKET_BYTES,
        )
        if layout == self._layout:  # the observed order gives the same buckets: keep their memory and views
            return
        self._layout = layout
        self.buckets = [
            Bucket(s, self.params, self._bucket_dtype(self.params[s.params[0]]), s.index == len(layout) - 1)
            for s in layout
        ]
        self._missing_count = 0
        self._where: list[tuple[Bucket, int]] = [None] * self._n  # type: ignore[list-item]
        for b in self.buckets:
            for pos, i in enumerate(b.indices):
                self._where[i] = (b, pos)

    def _bucket_dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.policy.bucket_dtype(p.dtype)

    def set_divisor(self, num_ranks: int) -> None:
        """Average over `num_ranks` (join() with divide_by_initial_world_size=False); the built-in hook only."""
        self._inv = 1.0 / num_ranks

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if self._hook is not sum_hook:
            raise RuntimeError(
                f"{self._tag}register_comm_hook can be called only once per model (like torch); "
                f"a hook {getattr(self._hook, '__name__', self._hook)!r} is already registered"
            )
        if not callable(hook):
            raise TypeError(f"{self._tag}the communication hook must be callable, got {hook!r}")
        self._hook, self._hook_state, self._prescale = hook, state, False

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
        """pre_forward (after the forward): expect hooks; find this rank's unused parameters."""
        self._reset_step()
        self._expect = True
        self.t_forward_start, self.t_forward_end = t_forward_start, time.perf_counter()
        if self._static_hits is not None:
            self._unused_now = self._static_unused
        elif self.policy.find_unused_parameters and not self.policy.static_graph:
            self._unused_now = _unreached(outputs, self._index_of)
        for t in outputs:
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _reset_step(self) -> None:
        self._ready = bytearray(self._n)
        self._hits = [0] * self._n if self.policy.static_graph else None
        self._defer = self._first_static
        self._next = 0
        self._step_bytes = 0
        self._started = False
        self._queued = False
        self._unused_now = []
        self.t_forward_start = self.t_forward_end = self.t_backward = 0.0
        for b in self.buckets:
            b.pending, b.future, b.hook_buffer = len(b.params), None, b.buffer

    @property
    def _index_of(self) -> dict[int, int]:
        cached = getattr(self, "_index_cache", None)
        if cached is None:
            cached = self._index_cache = {id(p): i for i, p in enumerate(self.params)}
        return cached

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # Queued from an output's gradient, the callback belongs to the outermost backward, even when
        # reentrant checkpointing runs nested backwards that fire parameter hooks.
        if self._expect and not self._queued:
            self._queue_finalize()

    def _queue_finalize(self) -> None:
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.finalize)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- post_accumulate_grad

    def post_accumulate_grad(self, i: int) -> None:
        """The per-parameter hook: param i's .grad is complete for this backward."""
        self._used[i] = 1
        if not self._expect:
            return  # no_sync, eval, or a backward that did not follow our forward: accumulate locally
        if not self._started:
            self._start_backward()
        if self._hits is not None:
            self._hits[i] += 1
            if self._static_hits is not None and self._hits[i] < self._static_hits[i]:
                return
        if self._ready[i]:
            self._ready_again(i)
            return
        self._mark_ready(i)

    def _start_backward(self) -> None:
        self._started = True
        self.t_backward = time.perf_counter()
        if not self._queued:
            self._queue_finalize()
        for i in self._unused_now:
            self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        self._ready[i] = 1
        if self._order is not None:
            self._order.append(i)
        b, pos = self._where[i]
        if b.eager and self.world > 1:
            self._copy_in_one(b, pos)
        b.pending -= 1
        if b.pending == 0 and not self._defer:
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._launch(self.buckets[self._next])
                self._next += 1

    @property
    def _first_static(self) -> bool:
        # static_graph's first step reduces at the end: how often each parameter fires is not known yet.
        return self.policy.static_graph and self._static_hits is None

    def _copy_in_one(self, b: Bucket, pos: int) -> None:
        grad, view = b.params[pos].grad, b.views[pos]
        if grad is None:
            view.zero_()
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
            if b.eager and self.world > 1:
                self._copy_in_one(b, pos)  # the grad grew since: copy the total again
            return
        raise RuntimeError(
            f"{self._tag}parameter {self.names[i]!r} received a gradient again after its bucket was "
            "reduced in this backward (it is used in several autograd passes, as with reentrant "
            "activation checkpointing). Pass static_graph=True if the graph is the same every step, or "
            "use torch.utils.checkpoint with use_reentrant=False, and do not combine reentrant "
            "checkpointing with find_unused_parameters=True"
        )

    # ---------------------------------------------------------------- launch

    def _launch(self, b: Bucket) -> None:
        if self.world == 1:
            return
        if b.solo:
            self._solo_buffer(b)
        elif not b.eager:
            grads = [p.grad for p in b.params]
            if any(g is None for g in grads):
                for pos in range(len(grads)):
                    self._copy_in_one(b, pos)
            else:
                torch._foreach_copy_(b.views, grads)  # type: ignore[arg-type]
                if self._prescale:
                    b.buffer.mul_(self._inv)
        self._step_bytes += b.hook_buffer.numel() * b.hook_buffer.element_size()  # gradient payload
        if b.status is not None and self._hook is sum_hook:
            b.status.fill_(float(self._missing_count))
            b.hook_buffer = b.storage  # type: ignore[assignment]
        b.t_launch = time.perf_counter()
        fut = self._hook(self._hook_state, GradBucket(b, len(self.buckets)))
        fut.add_done_callback(_stamp_done(b))
        b.future = fut

    def _solo_buffer(self, b: Bucket) -> None:
        # Reduce .grad itself when it can be (contiguous, bucket dtype); else a temporary copy.
        p = b.params[0]
        grad = p.grad
        if grad is not None and grad.dtype == b.dtype and grad.is_contiguous():
            buf = grad
        elif grad is None:
            buf = torch.zeros(p.shape, dtype=b.dtype, device=p.device)
        else:
            buf = grad.to(b.dtype, memory_format=torch.contiguous_format, copy=True)
        if self._prescale:
            buf.mul_(self._inv)
        b.hook_buffer = buf.view(-1)

    # ---------------------------------------------------------------- finalize

    def finalize(self) -> None:
        """End of backward: fill in, launch the rest, agree on unused parameters, wait, write back."""
        self._queued = False
        if not self._expect:
            return
        t_end_backward = time.perf_counter()
        missing = [i for i in range(self._n) if not self._ready[i]] if 0 in self._ready else []
        self._missing_count = len(missing)
        for i in missing:
            self._mark_ready(i)  # zeros or no_sync-accumulated grads: every rank launches every bucket
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        verdict = self._agree_on_unused(missing)
        self._write_back()
        if verdict is None:  # the count travelled in the last bucket's status element
            total = int(self.buckets[-1].status.item()) if self.buckets[-1].status is not None else 0
            verdict = self._name_unused(missing) if total else ""
        self._missing_count = 0
        self._finish_step(t_end_backward, missing)
        if verdict:
            raise UnusedParameterError(verdict)

    def _agree_on_unused(self, missing: list[int]) -> str | None:
        """An error message (the same on every rank), '' when all is well, None: read the status element."""
        tolerant = self.policy.find_unused_parameters or self.policy.static_graph
        if self.world == 1:
            self._globally_unused = {i for i in missing} if tolerant else set()
            return "" if tolerant or not missing else self._unused_message({0: [self.names[i] for i in missing]})
        if self._static_hits is not None:
            return ""  # learned in the first step: the graph does not change
        if tolerant:
            used = torch.frombuffer(bytearray(self._used), dtype=torch.uint8).to(torch.int32)
            dist.all_reduce(used, group=self.group)
            self._globally_unused = {i for i in (used == 0).nonzero().flatten().tolist()}
            return ""
        if self._hook is sum_hook and self.buckets[-1].status is not None:
            return None
        count = torch.tensor([len(missing)], dtype=torch.int64)
        dist.all_reduce(count, group=self.group)
        return self._name_unused(missing) if int(count.item()) else ""

    def _name_unused(self, missing: list[int]) -> str:
        per_rank = all_gather_object([self.names[i] for i in missing], group=self.group)
        return self._unused_message({r: names for r, names in enumerate(per_rank) if names})

    def _unused_message(self, per_rank: dict[int, list[str]]) -> str:
        parts = [
            f"rank {r}: {', '.join(repr(n) for n in names[:10])}{' ...' if len(names) > 10 else ''}"
            for r, names in per_rank.items()
        ]
        return (
            f"{self._tag}parameters received no gradient in this backward although every parameter was "
            f"expected to: {'; '.join(parts)}. If some parameters are not used in every forward, pass "
            "find_unused_parameters=True (SyncPolicy(find_unused_parameters=True) for replicate); if they "
            "are never used, delete them or set requires_grad=False"
        )

    def _write_back(self) -> None:
        as_view = self.policy.gradient_as_bucket_view
        skip = self._globally_unused
        for b in self.buckets:
            if b.future is None:
                continue
            value = b.future.wait()
            result = value[0] if isinstance(value, list) else value
            if b.solo:
                self._write_back_solo(b, result)
                continue
            same = result.data_ptr() == b.buffer.data_ptr() and result.numel() >= b.buffer.numel()
            views = b.views if same else flat_views(result.reshape(-1), b.params)
            grads = [p.grad for p in b.params]
            if not as_view and not (skip and any(i in skip for i in b.indices)) and all(
                g is not None and g.dtype == v.dtype for g, v in zip(grads, views)
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
        if p.grad is None:
            p.grad = result.view(p.shape).to(p.dtype)
        elif result.data_ptr() != p.grad.data_ptr():
            p.grad.copy_(result.view(p.shape))

    def _finish_step(self, t_end_backward: float, missing: list[int]) -> None:
        if self._first_static:
            self._static_hits = [max(h, 1) for h in self._hits or [0] * self._n]
            self._static_unused = list(missing)
        now = time.perf_counter()
        spans = [(b.t_launch, max(b.t_done, b.t_launch)) for b in self.buckets if b.future is not None]
        comm = union_ms(spans)
        self.stats.record(
            StepStats(
                step=self.stats.steps + 1,
                forward_ms=(self.t_forward_end - self.t_forward_start) * 1000.0 if self.t_forward_start else 0.0,
                backward_ms=(t_end_backward - self.t_backward) * 1000.0 if self.t_backward else 0.0,
                comm_ms=comm,
                comm_hidden_ms=union_ms(spans, until=t_end_backward),
                finalize_ms=(now - t_end_backward) * 1000.0,
                bytes_communicated=self._step_bytes,
            )
        )
        self._expect = False
        self._used = bytearray(self._n)
        self._order_complete = self._order is not None


    # ---------------------------------------------------------------- join: a joined rank's step

    def shadow_backward(self) -> None:
        """A rank that ran out of inputs inside join(): the collectives of a synced backward, with zeros.

        The mirror of launch + finalize on a training rank, in the same order: every bucket through the
        communication hook (same sizes and dtypes, the status element included), then the unused-parameter
        agreement, and if a training rank lacks gradients, the same UnusedParameterError here too.
        """
        if self.world == 1:
            return
        futures = []
        for b in self.buckets:
            b.hook_buffer = self._zeros_like_launch(b)
            futures.append(self._hook(self._hook_state, GradBucket(b, len(self.buckets))))
        self._used = bytearray(self._n)  # this rank used nothing in the step it shadows
        verdict = self._agree_on_unused([])
        values = [f.wait() for f in futures]
        for b in self.buckets:
            b.hook_buffer = b.buffer
        if verdict is None:
            last = values[-1][0] if isinstance(values[-1], list) else values[-1]
            verdict = self._name_unused([]) if int(last.reshape(-1)[-1].item()) else ""
        if self._first_static:  # the training ranks have learned their static pattern in this step
            self._static_hits, self._static_unused = [1] * self._n, []
        if verdict:
            raise UnusedParameterError(verdict)

    def _zeros_like_launch(self, b: Bucket) -> torch.Tensor:
        if b.solo:
            p = b.params[0]
            return torch.zeros(p.numel(), dtype=b.dtype, device=p.device)
        zeros = torch.zeros_like(b.storage)  # type: ignore[arg-type]  # only solo buckets have none
        return zeros if b.status is not None and self._hook is sum_hook else zeros[: b.buffer.numel()]


def _unreached(outputs: Sequence[torch.Tensor], index_of: dict[int, int]) -> list[int]:
    """Indices of parameters whose AccumulateGrad node is not reachable from `outputs` (as torch does)."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad and id(t) in index_of:
            reached.add(index_of[id(t)])
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            if var is not None:
                if id(var) in index_of:
                    reached.add(index_of[id(var)])
            elif nxt not in seen:
                stack.append(nxt)
    return [i for i in range(len(index_of)) if i not in reached]


def _stamp_done(b: Bucket) -> Callable[[torch.futures.Future[Any]], None]:
    """A future callback that records when bucket b's reduction finished (for stats' hidden time)."""

    def stamp(_fut: torch.futures.Future[Any]) -> None:
        b.t_done = time.perf_counter()

    return stamp
