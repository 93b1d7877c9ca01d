"""How streaming DiLoCo cuts the model into fragments, and when each fragment syncs.

A fragment is a list of `Part`s: a parameter (by its index in the replica's parameter list) or a block of
its rows. Three layouts (SyncPolicy.fragment_layout):

- "sliced" (the default): every parameter's rows cut in F blocks, block f of each in fragment f: every
  fragment holds a piece of every layer, and the fragments are of equal size (the peak bytes of a sync
  are 1/F of DiLoCo's), which the strided layout is not where the layers differ in size;
- "strided": the model's layers (each module's own parameters, in order) dealt out in turn,
  layer i to fragment i mod F (Streaming DiLoCo's strided fragments: every fragment holds layers of every
  depth); with fewer layers than fragments, the parameters are dealt out;
- "contiguous": runs of parameters in order, of about equal size (fragment_bounds).

The fragments' syncs are staggered evenly over the round: fragment f at (f + 1) H / F + kH
(due_fragments).

The two lose the same within noise (benchmarks/results/2026-11-27-diloco_defaults.md); sliced is the
default for its even traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lockstep.errors import ConfigError
from lockstep.plan import FRAGMENT_LAYOUTS as LAYOUTS


@dataclass(frozen=True)
class Part:
    """Parameter `index` of the replica's list, rows [start, stop) of it (stop None: all of it)."""

    index: int
    start: int = 0
    stop: int | None = None

    def view(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parameter, or a view of its rows (writes through to the parameter)."""
        p = params[self.index]
        return p if self.stop is None else p.detach()[self.start : self.stop]


def fragment_bounds(numels: Sequence[int], fragments: int) -> list[range]:
    """Parameter index ranges, contiguous and in order, of about equal total size and at least one
    parameter each: fragment f ends at the first parameter where the running total reaches (f + 1) T / F."""
    n = len(numels)
    if not 1 <= fragments <= n:
        raise ConfigError(
            f"SyncPolicy(fragments={fragments}) needs 1 to {n} fragments: the model has {n} parameters"
        )
    total, cuts, running, i = sum(numels), [0], 0, 0
    for f in range(1, fragments):
        i = max(i, cuts[-1] + 1)
        running = sum(numels[:i])
        while i < n - (fragments - f) and running < f * total / fragments:
            running += numels[i]
            i += 1
        cuts.append(i)
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def layers(module: nn.Module, params: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices in `params` of each layer's parameters: a module's own (not its children's), in the
    order of module.named_modules(); a parameter shared by two modules counts with the first."""
    where = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    out = []
    for _, child in module.named_modules():
        own = [where[id(p)] for p in child.parameters(recurse=False) if id(p) in where and id(p) not in seen]
        seen.update(id(params[i]) for i in own)
        if own:
            out.append(own)
    missing = [i for i in range(len(params)) if id(params[i]) not in seen]
    return out + [[i] for i in missing]


def layout_fragments(
    module: nn.Module,
    params: Sequence[torch.Tensor],
    count: int,
    layout: str,
    *,
    held_rows: Sequence[range] | None = None,
) -> list[list[Part]]:
    """The `count` fragments of `params` (module's trainable parameters, in order) in `layout`. `held_rows`:
    a sharded model's, the rows of each parameter that this rank's shard holds; the parts are then views
    of the local shards, and a fragment is the same set of values as a replicated model's (the "sliced"
    layout cuts every parameter's rows whole, and each part is the share of its block that the shard
    holds, empty where it holds none of it)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"SyncPolicy.fragment_layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    if count == 1:
        return [[Part(i) for i in range(len(params))]]
    if layout == "contiguous":
        return [[Part(i) for i in r] for r in fragment_bounds([p.numel() for p in params], count)]
    if layout == "strided":
        groups = layers(module, params)
        if len(groups) < count:  # fewer layers than fragments: the parameters are dealt out instead
            groups = [[i] for i in range(len(params))]
        if len(groups) < count:
            raise ConfigError(
                f"SyncPolicy(fragments={count}) needs 1 to {len(groups)} fragments with "
                f"fragment_layout='strided': the model has {len(groups)} parameters; use fewer fragments"
            )
        out: list[list[Part]] = [[] for _ in range(count)]
        for i, group in enumerate(groups):
            out[i % count] += [Part(j) for j in group]
        return out
    out = _sliced(params, count, held_rows)
    if not all(out):
        raise ConfigError(
            f"SyncPolicy(fragments={count}, fragment_layout='sliced'): the model's parameters give fewer "
            f"than {count} pieces; use fewer fragments"
        )
    return out


def _sliced(
    params: Sequence[torch.Tensor], count: int, held_rows: Sequence[range] | None = None
) -> list[list[Part]]:
    """Every parameter's rows in `count` blocks (torch.tensor_split's sizes); a parameter of fewer rows
    than fragments (or none: a scalar) goes whole, to the fragments in turn. `held_rows`: layout_fragments'."""
    out: list[list[Part]] = [[] for _ in range(count)]
    turn = 0
    for i, p in enumerate(params):
        rows = p.shape[0] if p.dim() > 0 else 0
        if rows < count:
            out[turn % count].append(Part(i))
            turn += 1
            continue
        bounds = [0]
        for block in torch.tensor_split(torch.arange(rows), count):
            bounds.append(bounds[-1] + len(block))
        for f in range(count):
            start, stop = bounds[f], bounds[f + 1]
            if held_rows is not None:  # the block's rows in this shard, counted from the shard's first
                held = held_rows[i]
                start, stop = (min(max(row, held.start), held.stop) - held.start for row in (start, stop))
            out[f].append(Part(i, start, stop))
    return out


def due_fragments(step: int, every: int, count: int) -> list[int]:
    """The fragments of `count` synced (launched) after inner step `step` (1-based) with sync_every=`every`:
    fragment f at (f + 1) H / F + kH."""
    return [f for f in range(count) if step % every == ((f + 1) * every // count) % every]
