"""Membership in whole replica groups: a sharded run's rule (issue 46; docs/live.md).

A sharded run (`--shard-degree S`) holds each copy of its model in S shards, one per rank of a replica
group of S consecutive members. A rank lost takes its group's copy with it: the group's other members hold
shards of a copy no one can complete, so they leave with it, and the group is replaced whole or not at all.
The groups are the generation's members in order, S at a time; members leave and join S at a time, so every
survivor keeps its place in its group (its shard index), and with it the local shards it holds.

GroupState.group_size is 1 until the trainer says otherwise (`LiveGroup.hold_in_groups`): then every
member is a group of its own and these rules change nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

GROUP_LOST = (
    "its replica group lost rank"  # how a member left out with its group is marked dead (a member id)
)


def broken_groups(members: Sequence[int], size: int, gone: Collection[int]) -> dict[int, int]:
    """The members of `members` (a generation's, in order) whose replica group of `size` lost a member
    of `gone`, each with the first member its group lost; members of `gone` themselves are not listed."""
    out: dict[int, int] = {}
    for start in range(0, len(members), size):
        group = members[start : start + size]
        lost = [m for m in group if m in gone]
        if lost:
            out.update({m: lost[0] for m in group if m not in gone})
    return out


def lost_with_group(why: str) -> int | None:
    """The member whose loss took this one out with its replica group, read from its dead mark (`why`);
    None when it was lost itself."""
    _, found, rest = why.partition(GROUP_LOST + " ")
    return int(rest.split()[0]) if found and rest.split() and rest.split()[0].isdigit() else None


def group_of(member: int, generations: Sequence[Sequence[int]], size: int) -> tuple[int, ...]:
    """The replica group of `member` (groups of `size`) in the latest of `generations` (each one's members,
    in order) that holds it; (member,) when none does (a replacement not admitted yet) or `size` is 1."""
    if size > 1:
        for members in reversed(generations):
            if member in members:
                start = list(members).index(member) // size * size
                return tuple(members[start : start + size])
    return (member,)


def whole_groups(joiners: Sequence[int], size: int) -> list[int]:
    """The first joiners that make whole groups of `size` (the rest wait for their group to be complete)."""
    return list(joiners[: len(joiners) - len(joiners) % size])
