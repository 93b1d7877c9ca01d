"""What a sharded optimizer hands out to the ranks: whole parameters, or pieces of them.

With whole parameters, ZeRO-1 cannot divide the optimizer state by the world size when one parameter
dominates the model (the benchmark MLP's largest weight is two thirds of it: at 2 ranks its owner kept
two thirds of the state). Most optimizers update each element of a parameter from the same element of
its gradient and state, plus per-parameter scalars that depend on the step count alone (SGD, Adam,
AdamW, ...: `ELEMENTWISE`). For those, a parameter can be cut into pieces, each stepped on its own, with
the bits of the whole step (checked for every class listed, foreach or not). Each piece is a 1-D view of
the parameter's storage, so the step writes into the parameter; its gradient, a view of the parameter's
gradient, is set for the step only (`attach_grads` / `detach_grads`).

Pieces also bound the optimizer's temporaries: torch's single-tensor Adam allocates two tensors the size
of what it steps, 134 MiB for that weight at once, where a piece takes a few MiB.

The cut depends on the parameters alone (never on the world size), so a live-mode regroup keeps the same
units. Any other optimizer (one reading a parameter's norm or shape: LAMB, Adafactor, a subclass that may
change the math) keeps whole parameters.

Two things every restricted step of the user's optimizer shares live here, once: the table of
elementwise optimizers (`ELEMENTWISE_OPTIMIZERS`: which classes may be stepped in pieces, and which of
them the engine also steps bucket by bucket during backward, overlapped_optimizer.py) and the swap of
the optimizer's param lists (and state) for the duration of one step (`swapped_params`), used by the
sharded step (shard_optimizer.py) and the overlapped one alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import InternalError
from lockstep.runtime.progress import PROGRESS
from lockstep.runtime.waits import wait_tracked
from lockstep.torch_private import foreach_copy_

# Exactly these classes (not subclasses): the update of each element reads only that element's gradient
# and state (and per-parameter scalars of the step count), so a step over some parameters, or over 1-D
# pieces of them, gives the whole step's bits (tests/unit/test_shard_units.py checks every class). The
# value: whether the engine also steps the class bucket by bucket during backward (overlap_optimizer),
# which is tested for those classes alone (tests/multiproc/test_overlap_optimizer.py); the others fall back.
ELEMENTWISE_OPTIMIZERS: dict[type[torch.optim.Optimizer], bool] = {
    torch.optim.SGD: True,
    torch.optim.Adam: True,
    torch.optim.AdamW: True,
    torch.optim.Adamax: False,
    torch.optim.NAdam: False,
    torch.optim.RAdam: False,
    torch.optim.RMSprop: False,
    torch.optim.Adagrad: False,
}
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = tuple(ELEMENTWISE_OPTIMIZERS)  # cut into pieces
OVERLAPPED: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls for cls, overlaps in ELEMENTWISE_OPTIMIZERS.items() if overlaps
)  # stepped bucket by bucket


@contextmanager
def swapped_params(
    optimizer: torch.optim.Optimizer, params: Sequence[list[torch.Tensor]], state: Any
) -> Iterator[None]:
    """For the block, param_groups[g]['params'] is `params[g]` and the optimizer's `state` is `state` (its
    own, or a share's); its lists and state are as they were after, whatever the block raised. lr, betas
    and the rest of each group stay: a scheduler's lr applies, the optimizer's hooks run."""
    saved, own_state = [group["params"] for group in optimizer.param_groups], optimizer.state
    try:
        for group, members in zip(optimizer.param_groups, params):
            group["params"] = members
        optimizer.state = state
        yield
    finally:
        optimizer.state = own_state
        for group, members in zip(optimizer.param_groups, saved):
            group["params"] = members


MIN_PIECE_NUMEL = 1 << 18  # 1 MiB of fp32: smaller pieces would cost more Python per step than they save
PIECES_PER_MODEL = 32  # the model in about this many pieces: balanced shares up to a few dozen ranks


def default_piece_numel(params: Sequence[torch.Tensor]) -> int:
    """Elements per piece when none is given: the model in about PIECES_PER_MODEL pieces, at least 1 MiB."""
    total = sum(p.numel() for p in params)
    return max(MIN_PIECE_NUMEL, -(-total // PIECES_PER_MODEL))


def _spans(p: torch.Tensor, piece_numel: int | None) -> list[tuple[int, int]]:
    """The element ranges of p's pieces; none when p stays whole (small, not cut, or not contiguous)."""
    n = p.numel()
    if piece_numel is None or n <= piece_numel or not p.is_contiguous():
        return []
    return [(a, min(a + piece_numel, n)) for a in range(0, n, piece_numel)]


class Units:
    """The optimizer's parameters as units: `tensors[u]` is the parameter itself (`bounds[u]` None) or a
    1-D view of elements `bounds[u]` of the flattened parameter `param_of[u]`; `of_param[i]` lists the
    units of parameter i, in order."""

    def __init__(self, params: Sequence[torch.Tensor], piece_numel: int | None) -> None:
        self.params = list(params)
        self.tensors: list[torch.Tensor] = []
        self.param_of: list[int] = []
        self.bounds: list[tuple[int, int] | None] = []
        self.of_param: list[list[int]] = []
        for i, p in enumerate(self.params):
            spans = _spans(p, piece_numel)
            self.of_param.append(list(range(len(self.tensors), len(self.tensors) + max(1, len(spans)))))
            if not spans:
                self._add(i, p, None)
            for a, b in spans:
                self._add(i, p.detach().view(-1)[a:b], (a, b))

    def _add(self, param: int, tensor: torch.Tensor, bounds: tuple[int, int] | None) -> None:
        self.tensors.append(tensor)
        self.param_of.append(param)
        self.bounds.append(bounds)

    @property
    def split(self) -> bool:
        """Some parameter is in pieces."""
        return len(self.tensors) > len(self.params)

    def sizes(self) -> list[int]:
        return [t.numel() * t.element_size() for t in self.tensors]

    # ---- gradients: a piece's is a view of its parameter's, for the step only ----------------------------

    def attach_grads(self, units: Sequence[int]) -> None:
        """Give each piece among `units` its share of its parameter's gradient (none when it has none)."""
        for u in units:
            bounds = self.bounds[u]
            if bounds is not None:
                grad = self.params[self.param_of[u]].grad
                self.tensors[u].grad = None if grad is None else grad.reshape(-1)[bounds[0] : bounds[1]]

    def detach_grads(self, units: Sequence[int]) -> None:
        """Drop the pieces' gradient views, which would otherwise keep a freed gradient's memory alive."""
        for u in units:
            if self.bounds[u] is not None:
                self.tensors[u].grad = None

    # ---- state: per unit in the optimizer, per parameter in a state_dict ----------------------------------

    def split_state(
        self, param: int, state: dict[str, Any], units: Sequence[int]
    ) -> dict[int, dict[str, Any]]:
        """Parameter `param`'s state entry as the entries of its `units`: a tensor shaped like the parameter
        is cut as the parameter is (copies, so that the full tensor can be freed); any other value (the step
        count, a scalar) is the same for every piece, each with its own copy (a piece steps its own)."""
        p = self.params[param]
        out: dict[int, dict[str, Any]] = {}
        for u in units:
            bounds = self.bounds[u]
            if bounds is None:
                out[u] = state
                continue
            out[u] = {
                key: (
                    value.reshape(-1)[bounds[0] : bounds[1]].clone()
                    if isinstance(value, torch.Tensor) and value.shape == p.shape
                    else (value.clone() if isinstance(value, torch.Tensor) else value)
                )
                for key, value in state.items()
            }
        return out

    def merge_state(self, param: int, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The state entry of parameter `param` from its units' entries, in unit order (split_state undone)."""
        units = self.of_param[param]
        if len(states) != len(units):
            raise InternalError(
                f"lockstep bug: parameter {param} has {len(units)} pieces but {len(states)} state entries"
            )
        if self.bounds[units[0]] is None:
            return states[0]
        p, first = self.params[param], states[0]
        return {
            key: (
                torch.cat([s[key].reshape(-1) for s in states]).view(p.shape)
                if isinstance(value, torch.Tensor) and value.shape == self.tensors[units[0]].shape
                else value
            )
            for key, value in first.items()
        }


def partition(sizes: Sequence[int], world: int) -> list[int]:
    """The owner rank of each parameter: the largest first, each to the rank with the fewest bytes so far
    (the lowest rank on a tie). A pure function of the sizes in parameter order: every rank computes it."""
    loads = [0] * world
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep parameter order
        owner = min(range(world), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += sizes[index]
    return owners


SMALL_BYTES = 1024 * 1024  # smaller parameters travel packed, one flat message per owner, dtype, device


class ParamGather:
    """Every parameter from its owner, all messages in flight at once: a large parameter broadcast in place
    (no copy, no extra memory), the small ones packed per (owner, device, dtype) into one flat message kept
    from step to step (a few hundred tiny layers would otherwise cost a collective each)."""

    def __init__(self, params: Sequence[torch.Tensor], owners: Sequence[int], rank: int) -> None:
        self.rank = rank
        self.messages: list[tuple[int, torch.Tensor, list[torch.Tensor]]] = []  # owner, message, packed
        small: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p, owner in zip(params, owners):
            if p.numel() * p.element_size() >= SMALL_BYTES and p.is_contiguous():
                self.messages.append((owner, p.detach(), []))
            else:
                small.setdefault((owner, p.device, p.dtype), []).append(p)
        for (owner, device, dtype), packed in small.items():
            self.messages.append(
                (owner, torch.empty(sum(p.numel() for p in packed), dtype=dtype, device=device), packed)
            )

    def __call__(self, group: dist.ProcessGroup | None, src: Callable[[int], int]) -> None:
        self.wait(self.launch(group, src))

    def launch(self, group: dist.ProcessGroup | None, src: Callable[[int], int]) -> list[tuple[Any, Any]]:
        """Start every message (the owner packs its small parameters first); `wait()` finishes them."""
        launched = []
        for owner, message, packed in self.messages:
            if packed and owner == self.rank:
                torch.cat([p.detach().reshape(-1) for p in packed], out=message)
            record = PROGRESS.issue("broadcast (sharded optimizer: parameters)", (message,), group)
            launched.append((record, dist.broadcast(message, src=src(owner), group=group, async_op=True)))
        return launched

    def wait(self, launched: list[tuple[Any, Any]]) -> None:
        """Wait for the messages `launch()` started; the receivers unpack the packed ones."""
        for (owner, message, packed), (record, work) in zip(self.messages, launched):
            wait_tracked(record, work)
            if packed and owner != self.rank:
                views = message.split([p.numel() for p in packed])
                foreach_copy_([p.detach() for p in packed], [v.view_as(p) for v, p in zip(views, packed)])
