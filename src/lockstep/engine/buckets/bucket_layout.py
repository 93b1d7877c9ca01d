"""Bucket assignment: which parameters share a flat gradient buffer, as a pure function of their specs.

No process group and no tensors here, only sizes, devices and dtypes, so that every rank computes the
same layout from the same inputs and the rules can be unit-tested with fake devices:

- a bucket never mixes devices or dtypes (a replica may span several devices: cpu + cuda:0 + cuda:1);
- parameters are visited in reverse registration order (roughly the order in which backward produces
  their gradients), or in an observed ready order after the first iteration;
- per (device, dtype), the first bucket closes once it holds `first_cap_bytes` (small, so that the first
  all-reduce starts early in backward) and every later one once it holds `cap_bytes`;
- buckets are numbered in the order in which their first parameter is visited: the order of launch;
- optionally, a parameter of at least `solo_bytes` gets a bucket of its own (`solo`): the reducer then
  reduces its `.grad` in place, with no copy into and out of a flat buffer. The last bucket is never
  solo (the reducer appends a status element to it);
- a sparse parameter (nn.Embedding(sparse=True)) always has a bucket of its own, the last one included:
  sparse gradients cannot share a flat buffer.

The drop-in class takes torch's layout instead (SyncPolicy.torch_bucket_layout): the reducer asks torch's
own assignment function for lists of indices, and `specs_from_index_lists` describes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lockstep.errors import ConfigError, InternalError


@dataclass(frozen=True)
class ParamSpec:
    """What bucket assignment needs to know of one parameter (index = position in registration order)."""

    name: str
    numel: int
    nbytes: int  # bytes it takes in the bucket (numel times the element size of the bucket dtype)
    device: str
    dtype: str
    sparse: bool = False


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: the parameter indices it holds, in their order inside the flat buffer."""

    index: int
    device: str
    dtype: str
    param_indices: tuple[int, ...]  # positions in registration order, in buffer order
    nbytes: int
    solo: bool = False
    sparse: bool = False


def assign_buckets(
    params: Sequence[ParamSpec],
    *,
    cap_bytes: int,
    first_cap_bytes: int,
    order: Sequence[int] | None = None,
    solo_bytes: int | None = None,
) -> list[BucketSpec]:
    """Group `params` into buckets (see the module docstring); `order` is a permutation of indices."""
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        # Reachable from the user's settings: SyncPolicy(bucket_cap_mb=1e-9) is positive but 0 bytes.
        raise ConfigError(
            f"bucket caps must be positive, got cap_bytes={cap_bytes!r} first_cap_bytes={first_cap_bytes!r}; "
            "pass SyncPolicy(bucket_cap_mb=..., first_bucket_mb=...) of at least 1 byte (1e-6 MiB) each"
        )
    visit = list(reversed(range(len(params)))) if order is None else list(order)
    _check_permutation(visit, len(params))
    position = {index: pos for pos, index in enumerate(visit)}
    open_buckets: dict[tuple[str, str], list[int]] = {}
    open_bytes: dict[tuple[str, str], int] = {}
    closed_count: dict[tuple[str, str], int] = {}
    closed: list[tuple[tuple[str, str], list[int], int]] = []
    solos: set[int] = set()
    for index in visit:
        spec = params[index]
        key = (spec.device, spec.dtype)
        if spec.sparse or (solo_bytes is not None and spec.nbytes >= solo_bytes):
            closed.append((key, [index], spec.nbytes))
            solos.add(index)
            continue
        members = open_buckets.setdefault(key, [])
        members.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + spec.nbytes
        limit = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= limit:
            closed.append((key, members, open_bytes[key]))
            closed_count[key] = closed_count.get(key, 0) + 1
            del open_buckets[key]
            open_bytes[key] = 0
    for key, members in open_buckets.items():
        closed.append((key, members, open_bytes[key]))
    closed.sort(key=lambda item: position[item[1][0]])
    return [
        BucketSpec(
            index=i,
            device=key[0],
            dtype=key[1],
            param_indices=tuple(members),
            nbytes=nbytes,
            solo=members[0] in solos and (i < len(closed) - 1 or params[members[0]].sparse),
            sparse=params[members[0]].sparse,
        )
        for i, (key, members, nbytes) in enumerate(closed)
    ]


def specs_from_index_lists(
    params: Sequence[ParamSpec], index_lists: Sequence[Sequence[int]]
) -> list[BucketSpec]:
    """BucketSpecs for buckets given as lists of parameter indices, in launch order (torch's layout)."""
    _check_permutation([i for members in index_lists for i in members], len(params))
    return [
        BucketSpec(
            index=i,
            device=params[members[0]].device,
            dtype=params[members[0]].dtype,
            param_indices=tuple(members),
            nbytes=sum(params[m].nbytes for m in members),
            solo=params[members[0]].sparse,
            sparse=params[members[0]].sparse,
        )
        for i, members in enumerate(index_lists)
    ]


def complete_order(observed: Sequence[int], num_params: int) -> list[int]:
    """A permutation from an observed ready order: first sightings kept, the never-seen ones appended
    in reverse registration order (they were unused; where they go does not matter for speed)."""
    seen: set[int] = set()
    order: list[int] = []
    for index in observed:
        if not 0 <= index < num_params:
            raise InternalError(
                f"lockstep bug: the observed ready order names parameter index {index!r}, expected "
                f"0..{num_params - 1} (the reducer records only its own indices); please report it"
            )
        if index not in seen:
            seen.add(index)
            order.append(index)
    order.extend(i for i in reversed(range(num_params)) if i not in seen)
    return order


def _check_permutation(visit: Sequence[int], num_params: int) -> None:
    # Orders and index lists come from the reducer (complete_order, torch's assignment), never the user.
    if sorted(visit) != list(range(num_params)):
        raise InternalError(
            f"lockstep bug: a bucket order must be a permutation of 0..{num_params - 1}, got "
            f"{list(visit)[:20]!r}{' ...' if len(visit) > 20 else ''} ({len(visit)} entries); please report it"
        )
