"""PowerSGD: low-rank gradient compression with error feedback and warm start, as a communication hook.

The algorithm is PowerSGD (Vogels et al., 2019) with torch's knobs and names (`PowerSGDState`,
`powerSGD_hook`). Each gradient tensor of a bucket with 2+ dimensions, viewed as an n x m matrix M
(rows = first dimension), is sent as a rank-r pair when that pays, (n + m) * r * min_compression_rate
< n * m; everything else (biases, small or thin tensors) is all-reduced as it is. Per step and bucket:

1. M += error (error feedback: what compression dropped last step on this rank);
2. Q = last step's averaged Q (warm start) or random (same seed on every rank), orthonormalized;
3. P = M Q; all-reduce P (sum) together with the uncompressed tensors (average);
4. orthonormalize P; Q = M^T P; all-reduce Q (average);
5. M ~ P Q^T is written into the bucket; error = (M + error) - P Q^T.

Why this does not abort on gloo like torch's hook. torch's hook launches its P and Q all-reduces from future
callbacks, on the backend's worker threads, while the autograd thread launches the next buckets' collectives
on the same group. gloo pairs collectives by the order each process enqueues them, so with more than one
bucket the ranks interleave differently and gloo aborts ("Received data size doesn't match expected size";
torch 2.13, two buckets of 512x512 layers, 2 CPU ranks, the first compressed step). Here the thread that
calls the hook launches every collective, in one order on every rank: bucket k launches its P (and
uncompressed) all-reduce, then finishes bucket k-1's P phase and launches its Q all-reduce; the last bucket
drains everything before it returns, so the engine's later collectives (torch's unused-parameter map,
lockstep's agreement on unused parameters) come after ours on every rank. Callbacks only compute locally; a
bucket's Q phase waits for its own P all-reduce, which overlaps with the next bucket's backward.

Bucket layouts change once (torch and lockstep rebuild buckets after the first step): per-bucket memory
is keyed by bucket index and by the bucket's parameters, and is reset when they change, so any start
iteration is safe (torch requires start_powerSGD_iter >= 2 with error feedback or warm start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.comm.compression import (
    HookFuture,
    HookState,
    all_reduce_future,
    torch_signature,
    world_of,
)
from lockstep.errors import CommHookTypeError, CommHookValueError, ConfigError, InternalError

# ---------------------------------------------------------------- pure parts: planning and algebra


@dataclass(frozen=True)
class MatrixPlan:
    """One compressed tensor of a bucket: where it lives in the buffer, its P, its Q and its error."""

    offset: int
    rows: int
    cols: int
    rank: int
    p_offset: int
    q_offset: int
    e_offset: int


@dataclass(frozen=True)
class BucketPlan:
    """Which tensors of a bucket are compressed and where everything goes; the same on every rank."""

    numel: int
    matrices: tuple[MatrixPlan, ...]
    uncompressed: tuple[tuple[int, int], ...]  # (offset, numel) runs of the buffer, adjacent runs merged
    p_numel: int
    q_numel: int
    e_numel: int

    @property
    def uncompressed_numel(self) -> int:
        return sum(n for _, n in self.uncompressed)

    @property
    def compressed_numel(self) -> int:
        """Elements sent per step: uncompressed tensors plus every P and Q."""
        return self.uncompressed_numel + self.p_numel + self.q_numel


def plan_bucket(shapes: list[torch.Size], *, rank: int, min_compression_rate: float) -> BucketPlan:
    """Decide per tensor (from shapes alone, so every rank agrees) whether rank-`rank` compression pays."""
    matrices: list[MatrixPlan] = []
    runs: list[tuple[int, int]] = []
    offset = p_numel = q_numel = e_numel = 0
    for shape in shapes:
        numel = shape.numel()
        rows = shape[0] if len(shape) >= 2 else 0
        cols = numel // rows if rows else 0
        r = min(rows, cols, rank)
        if rows and r and (rows + cols) * r * min_compression_rate < numel:
            matrices.append(MatrixPlan(offset, rows, cols, r, p_numel, q_numel, e_numel))
            p_numel, q_numel, e_numel = p_numel + rows * r, q_numel + cols * r, e_numel + numel
        elif numel:
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + numel)
            else:
                runs.append((offset, numel))
        offset += numel
    return BucketPlan(offset, tuple(matrices), tuple(runs), p_numel, q_numel, e_numel)


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of a 2-D `matrix`, in place; returns a bool tensor: a column was zero.

    A zero column stays zero instead of becoming NaN (torch's hook divides by a zero norm when
    orthogonalization_epsilon is 0); the caller redraws a warm-start Q that degenerated that way.
    """
    tiny = torch.finfo(matrix.dtype).tiny
    zero = torch.zeros((), dtype=torch.bool, device=matrix.device)
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        norm = torch.linalg.vector_norm(col)
        zero |= norm == 0
        col.div_(norm + epsilon if epsilon > 0 else norm.clamp_min(tiny))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col * (col * rest).sum(dim=0, keepdim=True))
    return zero


# ---------------------------------------------------------------- state


class _BucketMemory:
    """What PowerSGD keeps per bucket between steps: the plan, P and Q, and this rank's error."""

    def __init__(
        self, key: tuple[Any, ...], plan: BucketPlan, like: torch.Tensor, error_feedback: bool
    ) -> None:
        self.key, self.plan = key, plan
        self.p = torch.empty(plan.p_numel, dtype=like.dtype, device=like.device)
        self.q = torch.empty(plan.q_numel, dtype=like.dtype, device=like.device)
        self.error = (
            torch.zeros(plan.e_numel, dtype=like.dtype, device=like.device) if error_feedback else None
        )
        self.has_q = False

    def views(self, flat: torch.Tensor, which: str) -> list[torch.Tensor]:
        out = []
        for mp in self.plan.matrices:
            if which == "p":
                out.append(flat[mp.p_offset : mp.p_offset + mp.rows * mp.rank].view(mp.rows, mp.rank))
            elif which == "q":
                out.append(flat[mp.q_offset : mp.q_offset + mp.cols * mp.rank].view(mp.cols, mp.rank))
            elif which == "e":
                out.append(flat[mp.e_offset : mp.e_offset + mp.rows * mp.cols].view(mp.rows, mp.cols))
            else:
                out.append(flat[mp.offset : mp.offset + mp.rows * mp.cols].view(mp.rows, mp.cols))
        return out


class PowerSGDState(HookState):
    """PowerSGD's settings and memory for every bucket; torch's `PowerSGDState` signature and names.

    Differences from torch: any `start_powerSGD_iter` >= 0 is allowed (memory is reset when a bucket's
    layout changes); a zero column is never turned into NaN; `batch_tensors_with_same_shape` is accepted
    and ignored (each tensor is compressed on its own); bytes are counted in `counter` (a BytesCounter).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        super().__init__(process_group)
        _check(
            matrix_approximation_rank, start_powerSGD_iter, min_compression_rate, orthogonalization_epsilon
        )
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.generator = torch.Generator().manual_seed(self.random_seed)
        self.memory: dict[int, _BucketMemory] = {}
        self._pending: list[_Job] = []

    def compression_stats(self) -> tuple[float, int, int]:
        """(rate, elements before, elements after) over all compressed steps so far, like torch's."""
        after = self.total_numel_after_compression
        return (
            self.total_numel_before_compression / after if after else 0.0,
            self.total_numel_before_compression,
            after,
        )

    def memory_for(self, bucket: Any, buffer: torch.Tensor) -> _BucketMemory:
        shapes = [g.shape for g in bucket.gradients()]
        key = (buffer.numel(), buffer.dtype, tuple(shapes), _param_ids(bucket))
        index = bucket.index()
        mem = self.memory.get(index)
        if mem is None or mem.key != key:  # first step, or the buckets were rebuilt: start afresh
            plan = plan_bucket(
                shapes, rank=self.matrix_approximation_rank, min_compression_rate=self.min_compression_rate
            )
            if plan.numel != buffer.numel():
                raise CommHookValueError(
                    f"PowerSGD: bucket {index} holds {buffer.numel()} elements but its gradients' shapes "
                    f"{shapes!r} add up to {plan.numel}; the bucket must pack its gradients back to back"
                )
            mem = self.memory[index] = _BucketMemory(key, plan, buffer, self.use_error_feedback)
        return mem


def _check(rank: int, start: int, rate: float, epsilon: float) -> None:
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(
            f"PowerSGD: matrix_approximation_rank={rank!r}; expected an int >= 1 (start from 1)"
        )
    if not isinstance(start, int) or start < 0:
        raise ConfigError(
            f"PowerSGD: start_powerSGD_iter={start!r}; expected an int >= 0 (torch's default is 1000)"
        )
    if not rate > 0:
        raise ConfigError(
            f"PowerSGD: min_compression_rate={rate!r}; expected a number > 0 (torch's default is 2)"
        )
    if not epsilon >= 0:
        raise ConfigError(f"PowerSGD: orthogonalization_epsilon={epsilon!r}; expected >= 0 (e.g. 0 or 1e-8)")


def _param_ids(bucket: Any) -> tuple[int, ...]:
    try:
        return tuple(id(p) for p in bucket.parameters())
    except (AttributeError, RuntimeError):
        return ()


# ---------------------------------------------------------------- the hook


class _Job:
    """One bucket between its P all-reduce and its Q all-reduce."""

    def __init__(self, state: PowerSGDState, mem: _BucketMemory, buffer: torch.Tensor, world: int) -> None:
        self.state, self.mem, self.buffer, self.world = state, mem, buffer, world
        self.step = state.iter
        self.matrices = mem.views(buffer, "m")
        self.result: HookFuture = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        self.unc = torch.empty(0)
        self.unc_future: torch.futures.Future[Any] | None = None
        self.p_future: torch.futures.Future[Any] | None = None


@torch_signature
def powerSGD_hook(state: PowerSGDState, bucket: Any) -> HookFuture:  # noqa: N802 (torch's name)
    """PowerSGD (see the module docstring); plain averaging until `state.start_powerSGD_iter`."""
    if not isinstance(state, PowerSGDState):
        raise CommHookTypeError(
            f"powerSGD_hook needs a lockstep PowerSGDState as its state, got {type(state).__name__}; register "
            "it as ddp.register_comm_hook(lockstep.hooks.PowerSGDState(process_group=None), powerSGD_hook)"
        )
    group = state.process_group
    world = world_of(group)
    buffer = bucket.buffer()
    mem = state.memory_for(bucket, buffer) if state.iter >= state.start_powerSGD_iter else None
    job = None
    if mem is None or not mem.plan.matrices:
        buffer.div_(world)
        state.counter.add(buffer)
        fut = all_reduce_future(buffer, group)
    else:
        job = _launch_p(state, mem, buffer, world)
        fut = job.result
    # Earlier buckets' Q phases, after this bucket's first collective: the same order on every rank. This
    # runs for uncompressed buckets too, or a compressed bucket followed only by uncompressed ones would
    # wait for its Q all-reduce forever.
    for older in _take_pending(state):
        _launch_q(older)
    if job is not None:
        if bucket.is_last():
            _launch_q(job)
        else:
            state._pending.append(job)
    if bucket.is_last():
        state.iter += 1
        state.counter.end_step()
    return fut


def _take_pending(state: PowerSGDState) -> list[_Job]:
    jobs, state._pending = state._pending, []
    live = []
    for job in jobs:
        if job.step == state.iter:
            live.append(job)
        else:  # left over from a backward that never reached its last bucket (an exception)
            job.result.set_exception(RuntimeError("PowerSGD: this step's backward did not finish"))  # type: ignore[arg-type]
    return live


def _launch_p(state: PowerSGDState, mem: _BucketMemory, buffer: torch.Tensor, world: int) -> _Job:
    """Error feedback, Q, P = M Q; launch the uncompressed and the P all-reduce."""
    job = _Job(state, mem, buffer, world)
    plan = mem.plan
    if mem.error is not None:
        for m, e in zip(job.matrices, mem.views(mem.error, "e")):
            m.add_(e)
            e.copy_(m)  # e holds M + error until the Q phase is done, then what compression dropped
    _prepare_q(state, mem)
    for m, p, q in zip(job.matrices, mem.views(mem.p, "p"), mem.views(mem.q, "q")):
        torch.mm(m, q, out=p)
    if plan.uncompressed:
        job.unc = torch.cat([buffer[o : o + n] for o, n in plan.uncompressed]).div_(world)
        state.counter.add(job.unc)
        job.unc_future = dist.all_reduce(job.unc, group=state.process_group, async_op=True).get_future()  # type: ignore[union-attr]
    state.counter.add(mem.p)
    job.p_future = dist.all_reduce(mem.p, group=state.process_group, async_op=True).get_future()  # type: ignore[union-attr]
    state.total_numel_before_compression += plan.numel
    state.total_numel_after_compression += plan.compressed_numel
    return job


def _prepare_q(state: PowerSGDState, mem: _BucketMemory) -> None:
    """Warm start: last step's averaged Q, orthonormalized; otherwise (or if it degenerated) random."""
    eps = state.orthogonalization_epsilon
    if state.warm_start and mem.has_q:
        degenerate = torch.zeros((), dtype=torch.bool, device=mem.q.device)
        for q in mem.views(mem.q, "q"):
            degenerate |= orthogonalize_(q, eps)
        if not bool(degenerate):  # Q is identical on every rank, so every rank decides the same
            return
    # The generator is seeded alike on every rank and drawn in the same order: the same Q everywhere.
    mem.q.copy_(torch.randn(mem.q.numel(), generator=state.generator, dtype=torch.float32))
    for q in mem.views(mem.q, "q"):
        orthogonalize_(q, eps)
    mem.has_q = True


def _launch_q(job: _Job) -> None:
    """Wait for P; orthonormalize it; Q = M^T P; launch the Q all-reduce; finish in its callback."""
    state, mem = job.state, job.mem
    _p_future_of(job).wait()
    for p in mem.views(mem.p, "p"):
        orthogonalize_(p, state.orthogonalization_epsilon)
    for m, p, q in zip(job.matrices, mem.views(mem.p, "p"), mem.views(mem.q, "q")):
        torch.mm(m.t(), p, out=q)
    state.counter.add(mem.q)
    q_future = dist.all_reduce(mem.q, group=state.process_group, async_op=True).get_future()  # type: ignore[union-attr]
    waits = [q_future] + ([job.unc_future] if job.unc_future is not None else [])
    done = torch.futures.collect_all(waits).then(lambda fut: _finish(job, fut))
    done.add_done_callback(lambda fut: _relay(fut, job.result))


def _p_future_of(job: _Job) -> torch.futures.Future[Any]:
    fut = job.p_future
    if fut is None:
        raise InternalError(
            f"lockstep bug: a PowerSGD bucket of {job.buffer.numel()} elements reached its Q phase without a "
            f"P all-reduce (step {job.step}); please report it"
        )
    return fut


def _finish(job: _Job, fut: torch.futures.Future[Any]) -> torch.Tensor:
    """Local only (runs on a backend thread): write P Q^T and the uncompressed average into the bucket."""
    for part in fut.value():
        part.value()  # re-raises a failed all-reduce
    mem, buffer = job.mem, job.buffer
    mem.q.div_(job.world)
    start = 0
    for o, n in mem.plan.uncompressed:
        buffer[o : o + n].copy_(job.unc[start : start + n])
        start += n
    errors = mem.views(mem.error, "e") if mem.error is not None else [None] * len(job.matrices)
    for m, p, q, e in zip(job.matrices, mem.views(mem.p, "p"), mem.views(mem.q, "q"), errors):
        torch.mm(p, q.t(), out=m)
        if e is not None:
            e.sub_(m)
    if not job.state.warm_start:
        mem.has_q = False
    return buffer


def _relay(src: torch.futures.Future[Any], dst: HookFuture) -> None:
    try:
        value = src.value()
    except Exception as exc:  # noqa: BLE001 (hand any failure to the engine waiting on dst)
        dst.set_exception(exc)  # type: ignore[arg-type]
    else:
        dst.set_result(value)
