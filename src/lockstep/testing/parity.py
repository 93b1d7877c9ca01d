"""Train the same weights on the same data with lockstep, torch's DDP and one process, and compare them.

The three-way check behind the engine's tests. On each of N gloo ranks, every kind of replica trains a
model built from the same seed on that rank's batches: lockstep's drop-in class (`"ours"`),
`lockstep.replicate` (`"replicate"`) and torch's own DistributedDataParallel (`"torch"`). The parent then
trains one process on the concatenation of every rank's batch, in rank order: with a mean loss, its
gradients are the average of the ranks' gradients, which is what data parallelism must compute.

    cases = {"mlp": ParityCase(model=build_mlp, data=batch, steps=4)}
    out = run_parity(cases, world=2)            # raises ParityError naming the first difference
    out["mlp"][rank]["ours"].params             # ParityRun: grads per synced step, params, buffers

Bitwise where the arithmetic allows it. The drop-in class lays its buckets out as torch does, so its
gradients, parameters and buffers must equal torch's bit for bit at any world size. `replicate` has its
own bucket layout, so on three or more ranks gloo may add the same numbers in another order: it is
compared with a tolerance there, but on two ranks each element is one addition (the same whatever the
order; halving is exact), so it must match bit for bit too. The replicas of every kind must equal each
other bit for bit (each rank applies the same averaged gradient). One process sums the whole batch in
another order: compared with a tolerance.

Everything handed to the ranks is pickled: model factories, data, loss and configure functions must be
defined at module level (or be functools.partial objects of such functions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from lockstep.engine import DistributedDataParallel, replicate
from lockstep.engine.core.policy import SyncPolicy
from lockstep.errors import ConfigError, ParityError, rank_tag
from lockstep.testing.spawn import run_distributed

KINDS = ("ours", "replicate", "torch")
DEFAULT_ATOL = 1e-6
DEFAULT_RTOL = 1e-5

ModelFactory = Callable[[int], nn.Module]  # seed -> a fresh module (the same seed gives the same weights)
DataFn = Callable[[int, int], tuple[Tensor, Tensor]]  # (rank, step) -> (inputs, targets) of that rank
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]  # (callable model, inputs, targets) -> scalar loss


def cross_entropy_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """The default loss: mean cross-entropy of the model's logits."""
    return F.cross_entropy(model(inputs), targets)


@dataclass(frozen=True)
class ParityCase:
    """One training to run three ways: model, data, steps, DDP arguments and the optimizer (SGD).

    - model: seed -> module. Ranks build with seed `rank` (different weights per rank: wrapping must make
      them equal by broadcasting rank 0's) unless rank_seeded is False; the single process uses seed 0.
    - data: (rank, step) -> this rank's batch; the single process concatenates ranks 0..N-1.
    - ddp_kwargs: torch's DistributedDataParallel arguments (SyncPolicy fields of the same names for
      `replicate`).
    - no_sync_every: accumulate that many micro-batches, all but the last under no_sync(); 0: sync each.
    - configure: (module, rank) -> None, a per-rank twist applied before wrapping. Such a case has no
      single-process equivalent.
    - single_process: whether one process on the concatenated batch is a valid reference (False for
      BatchNorm, whose statistics are per rank, and for cases with `configure`).
    """

    model: ModelFactory
    data: DataFn
    steps: int
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)
    no_sync_every: int = 0
    lr: float = 0.1
    momentum: float = 0.9
    rank_seeded: bool = True
    configure: Callable[[nn.Module, int], None] | None = None
    loss: LossFn = cross_entropy_loss
    single_process: bool = True


@dataclass
class ParityRun:
    """What one training produced: gradients after each synced backward, final parameters and buffers."""

    grads: list[list[Tensor | None]]
    params: list[Tensor]
    buffers: list[Tensor]


RankResult = dict[str, dict[str, ParityRun]]  # case name -> kind -> run, on one rank


def grads_of(module: nn.Module) -> list[Tensor | None]:
    """A copy of every parameter's gradient (None where it has none), in parameters() order."""
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def params_of(module: nn.Module) -> list[Tensor]:
    """A copy of every parameter, in parameters() order."""
    return [p.detach().clone() for p in module.parameters()]


def buffers_of(module: nn.Module) -> list[Tensor]:
    """A copy of every buffer, in buffers() order."""
    return [b.detach().clone() for b in module.buffers()]


def wrap(kind: str, module: nn.Module, **ddp_kwargs: Any) -> tuple[nn.Module, Any]:
    """(what to call forward on, what has no_sync/join/register_comm_hook) for one kind of replica."""
    if kind == "torch":
        ddp = TorchDDP(module, **ddp_kwargs)
        return ddp, ddp
    if kind == "ours":
        ours = DistributedDataParallel(module, **ddp_kwargs)
        return ours, ours
    if kind == "replicate":
        handle = replicate(module, policy=SyncPolicy(**ddp_kwargs))
        return module, handle
    raise ConfigError(f"replica kind {kind!r} is not one of {KINDS}; pick one of those")


def train_replica(kind: str, case: ParityCase) -> ParityRun:
    """Train one kind of replica on this rank (inside an initialised process group)."""
    rank = dist.get_rank()
    module = _build(case, rank if case.rank_seeded else 0)
    if case.configure is not None:
        case.configure(module, rank)
    model, handle = wrap(kind, module, **case.ddp_kwargs)
    return _train(model, module, case, lambda step: case.data(rank, step), handle.no_sync)


def train_single(case: ParityCase, world: int) -> ParityRun:
    """One process on the concatenation of ranks 0..world-1's batches: the mean loss over all samples."""
    if not case.single_process or case.configure is not None:
        raise ConfigError(
            "this ParityCase has no single-process reference (single_process=False or a per-rank "
            f"configure={case.configure!r}); compare it with torch's DDP only"
        )
    module = _build(case, 0)
    return _train(module, module, case, lambda step: _concatenated(case.data, world, step), None)


def train_cases(
    cases: Mapping[str, ParityCase], kinds: Sequence[str] = KINDS, setup: Callable[[], None] | None = None
) -> RankResult:
    """What each rank runs: every case with every kind, after `setup()` (e.g. a module constant to set)."""
    if setup is not None:
        setup()
    return {name: {kind: train_replica(kind, case) for kind in kinds} for name, case in cases.items()}


def run_parity(
    cases: Mapping[str, ParityCase],
    world: int,
    *,
    kinds: Sequence[str] = KINDS,
    exact: Collection[str] | None = None,
    setup: Callable[[], None] | None = None,
    timeout: float = 90.0,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
) -> dict[str, list[dict[str, ParityRun]]]:
    """Train every case on `world` gloo ranks with every kind, and one process where the case allows it;
    check them with assert_parity; return case name -> per-rank runs (for checks of the test's own).

    `exact`: the kinds that must equal torch's bit for bit; default exact_kinds(world).
    """
    exact = exact_kinds(world) if exact is None else exact
    per_rank: list[RankResult] = run_distributed(
        train_cases, world, args=(cases, kinds, setup), timeout=timeout
    )
    out = {name: [rank_result[name] for rank_result in per_rank] for name in cases}
    for name, case in cases.items():
        single = train_single(case, world) if case.single_process and case.configure is None else None
        assert_parity(out[name], single, exact=exact, atol=atol, rtol=rtol, what=name)
    return out


def exact_kinds(world: int) -> tuple[str, ...]:
    """The kinds whose results must equal torch's bit for bit on `world` ranks (see the module's doc)."""
    return ("ours", "replicate") if world <= 2 else ("ours",)


def assert_parity(
    runs: Sequence[Mapping[str, ParityRun]],
    single: ParityRun | None = None,
    *,
    reference: str = "torch",
    exact: Collection[str] = ("ours",),
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    what: str = "",
) -> None:
    """Check one case's runs (`runs[rank][kind]`) and raise ParityError at the first difference.

    Every kind other than `reference` against the reference on the same rank: gradients of every synced
    step, parameters and buffers (bitwise for kinds in `exact`, else within atol/rtol). Every kind
    against `single`, where given: gradients and parameters within atol/rtol. Every kind's parameters
    equal on every rank, bit for bit.
    """
    world = len(runs)
    for rank, by_kind in enumerate(runs):
        if reference not in by_kind:
            raise ParityError(
                f"{what} {rank_tag(rank, world)}runs of {sorted(by_kind)} but none of the reference "
                f"{reference!r}; train the reference kind too"
            )
        ref = by_kind[reference]
        for kind, run in by_kind.items():
            if kind == reference:
                continue
            tol = (0.0, 0.0) if kind in exact else (atol, rtol)
            label = f"{what} {rank_tag(rank, world)}{kind} vs {reference}"
            _compare_steps(run.grads, ref.grads, tol, label)
            assert_tensors_close(run.params, ref.params, *tol, what=f"{label} params")
            assert_tensors_close(run.buffers, ref.buffers, *tol, what=f"{label} buffers")
        if single is not None:
            for kind, run in by_kind.items():
                label = f"{what} {rank_tag(rank, world)}{kind} vs one process"
                _compare_steps(run.grads, single.grads, (atol, rtol), label)
                assert_tensors_close(run.params, single.params, atol, rtol, what=f"{label} params")
    for kind in runs[0]:
        for rank in range(1, world):
            assert_tensors_close(
                runs[rank][kind].params,
                runs[0][kind].params,
                0.0,
                0.0,
                what=f"{what} {kind} replicas: rank {rank} vs rank 0 params",
            )


def assert_tensors_close(
    got: Sequence[Tensor | None],
    expected: Sequence[Tensor | None],
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    *,
    what: str = "",
) -> None:
    """Two lists of tensors (None allowed where both are None) equal within atol/rtol; 0, 0: bit for bit."""
    if len(got) != len(expected):
        raise ParityError(f"{what}: {len(got)} tensors, expected {len(expected)}")
    for i, (a, b) in enumerate(zip(got, expected)):
        if a is None or b is None:
            if not (a is None and b is None):
                raise ParityError(
                    f"{what}[{i}]: {'None' if a is None else 'a tensor'}, expected "
                    f"{'None' if b is None else 'a tensor'}"
                )
            continue
        try:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
        except AssertionError as exc:
            raise ParityError(f"{what}[{i}] (atol={atol}, rtol={rtol}): {exc}") from None


def _compare_steps(
    got: list[list[Tensor | None]], expected: list[list[Tensor | None]], tol: tuple[float, float], label: str
) -> None:
    if len(got) != len(expected):
        raise ParityError(f"{label}: {len(got)} synced steps, expected {len(expected)}")
    for step, (a, b) in enumerate(zip(got, expected)):
        assert_tensors_close(a, b, *tol, what=f"{label} grads step {step}")


def _build(case: ParityCase, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # factories that draw their own weights get the same ones for the same seed
    return case.model(seed)


def _concatenated(data: DataFn, world: int, step: int) -> tuple[Tensor, Tensor]:
    parts = [data(rank, step) for rank in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _train(
    model: nn.Module,
    module: nn.Module,
    case: ParityCase,
    batch_of: Callable[[int], tuple[Tensor, Tensor]],
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None,
) -> ParityRun:
    """SGD over case.steps micro-batches; gradients recorded after each synced backward, before the step."""
    opt = torch.optim.SGD(module.parameters(), lr=case.lr, momentum=case.momentum)
    grads: list[list[Tensor | None]] = []
    for step in range(case.steps):
        inputs, targets = batch_of(step)
        sync = not case.no_sync_every or (step + 1) % case.no_sync_every == 0
        with contextlib.nullcontext() if sync or no_sync is None else no_sync():
            case.loss(model, inputs, targets).backward()
        if sync:
            grads.append(grads_of(module))
            opt.step()
            opt.zero_grad()
    return ParityRun(grads=grads, params=params_of(module), buffers=buffers_of(module))
