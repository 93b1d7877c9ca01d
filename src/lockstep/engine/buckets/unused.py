"""Unused parameters: which ones a forward did not reach, and how all ranks agree on them and on errors.

Every rank must issue the same collectives whatever it used, so parameters without a gradient are
filled in and reduced like the others; what differs is what happens afterwards:

- find_unused_parameters / static_graph: the ranks all-reduce a used-bitmap; a parameter no rank used
  keeps its `.grad` untouched (None stays None), like torch.
- otherwise a missing gradient is an error, raised on every rank: each rank's count of missing
  parameters is summed (in the last bucket's status element; with torch's bucket layout, a NaN flag in
  the last bucket calls for the count; with a user's comm hook, by a small all-reduce), and if the sum
  is not zero every rank gathers the names and raises the same message (`UnusedAgreement.signal`).

`UnusedAgreement` is the reducer's side of it, run in finalize (and in join()'s shadow step); the
functions below are its collectives and messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep.engine.buckets.bucket_memory import Bucket
from lockstep.runtime.collectives import all_gather_object
from lockstep.runtime.waits import tracked, wait_watching_membership


class UnusedAgreement:
    """How one reducer's ranks agree, after each synced backward, on the parameters without gradient."""

    def __init__(
        self,
        names: Sequence[str],
        tag: str,
        group: dist.ProcessGroup | None,
        device: torch.device,
        world_size: int,
    ) -> None:
        self.names, self.tag, self.group = list(names), tag, group
        self.device, self.world = device, world_size
        # parameters that no rank used since the last synced step: their .grad stays as it is (write-back)
        self.globally_unused: set[int] = set()

    def signal(self, *, tolerant: bool, summed: bool, last: Bucket) -> str:
        """How parameters without gradient reach the other ranks when they are an error (no
        find_unused_parameters, no static graph), without a collective of its own in the common case:

        - "status": lockstep's layout gives the last bucket an extra element, each rank's count, summed;
        - "nan": torch's layout has no room for it (an extra element would move gloo's ring chunks and
          change the sums' bits at world >= 3), so a rank with missing gradients writes NaN over the last
          bucket's last element. A sum that comes back NaN (a real NaN gradient, or a flag) is settled by
          a count all-reduce on every rank: the sum is the same everywhere, so all ranks take that path;
        - "count": a comm hook of the user's owns the bucket (it may not sum): an 8-byte all-reduce;
        - "tolerated": find_unused_parameters or a static graph: missing gradients are no error.

        `tolerant`: find_unused_parameters or a static graph; `summed`: the built-in hook reduces the
        buckets; `last`: the last bucket.
        """
        if tolerant:
            return "tolerated"
        if not summed:
            return "count"
        if last.status is not None:
            return "status"
        return "nan" if not last.sparse and last.nbytes and last.dtype.is_floating_point else "count"

    def agree(
        self, missing: list[int], used: bytearray, *, tolerant: bool, learned_static: bool, signal: str
    ) -> str | None:
        """An error message (the same on every rank), '' when all is well, None: read the last bucket.

        `used`: the parameters this rank used since the last synced step; `learned_static`: a static
        graph's first step is over (its pattern, and `globally_unused`, are known); `signal`: `signal()`.
        """
        if self.world == 1:
            # Used since the last synced step, as the bitmap all-reduce gives at any other world size.
            self.globally_unused = {i for i in range(len(used)) if not used[i]} if tolerant else set()
            if tolerant or not missing:
                return ""
            return missing_message(self.tag, {0: [self.names[i] for i in missing]})
        if learned_static:
            return ""  # learned in the first step: the graph does not change
        if tolerant:
            self.globally_unused = globally_unused(used, self.group, self.device)
            return ""
        if signal in ("status", "nan"):
            return None
        total = total_missing(len(missing), self.group, self.device)
        return name_missing(self.names, missing, self.tag, self.group) if total else ""

    def read(self, reduced: torch.Tensor, count: int, missing: list[int], signal: str) -> str:
        """The error message (or '') from the last bucket's reduced buffer (or its last element, a 0-dim
        view), as `signal` says it was put."""
        flag = reduced.item() if reduced.dim() == 0 else reduced.reshape(-1)[-1].item()
        if signal == "status":
            total = int(flag)
        elif flag != flag:  # NaN: a rank flagged missing gradients (or a real NaN): count them
            total = total_missing(count, self.group, self.device)
        else:
            total = 0
        return name_missing(self.names, missing, self.tag, self.group) if total else ""


def unreached(outputs: Sequence[torch.Tensor], index_of: dict[int, int]) -> list[int]:
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


def globally_unused(used: bytearray, group: dist.ProcessGroup | None, device: torch.device) -> set[int]:
    """Parameters that no rank used since the last synced step (one all-reduce of the used-bitmap)."""
    flags = torch.frombuffer(bytearray(used), dtype=torch.uint8).to(device=device, dtype=torch.int32)
    with tracked("allreduce (unused-parameter flags)", (flags,), group):
        wait_watching_membership(dist.all_reduce(flags, group=group, async_op=True))
    return set((flags == 0).nonzero().flatten().tolist())


def total_missing(count: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """Sum over ranks of the number of parameters without gradient (one 8-byte all-reduce)."""
    total = torch.tensor([count], dtype=torch.int64, device=device)
    with tracked("allreduce (missing-gradient count)", (total,), group):
        wait_watching_membership(dist.all_reduce(total, group=group, async_op=True))
    return int(total.item())


def name_missing(names: Sequence[str], missing: list[int], tag: str, group: dist.ProcessGroup | None) -> str:
    """The error message every rank raises: each rank's parameters without gradient, by name."""
    per_rank = all_gather_object([names[i] for i in missing], group=group)
    return missing_message(tag, {r: ranked for r, ranked in enumerate(per_rank) if ranked})


def missing_message(tag: str, per_rank: dict[int, list[str]]) -> str:
    parts = [
        f"rank {r}: {', '.join(repr(n) for n in names[:10])}{' ...' if len(names) > 10 else ''}"
        for r, names in per_rank.items()
    ]
    return (
        f"{tag}parameters received no gradient in this backward although every parameter was "
        f"expected to: {'; '.join(parts)}. If some parameters are not used in every forward, pass "
        "find_unused_parameters=True (SyncPolicy(find_unused_parameters=True) for replicate); if they "
        "are never used, delete them or set requires_grad=False"
    )
