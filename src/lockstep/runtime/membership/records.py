"""What live membership knows: one generation's members (`Membership`) and each change to them (`Fault`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Membership:
    """One generation of the group: its members' ids (runtime/membership/keys.py), in rank order, and this
    process's own id."""

    generation: int
    members: tuple[int, ...]
    member_id: int

    @property
    def rank(self) -> int:
        return self.members.index(self.member_id)

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclass
class Fault:
    """A membership change, as the run's summary records it."""

    generation: int
    lost: list[int]  # member ids
    how: dict[str, str]  # member id -> what the launcher saw ("killed by SIGKILL", "exit code 1")
    world_size: int  # after the change
    cause: str  # the error this rank saw
    kind: str = "lost"  # "lost": members left; "joined": replacements came in (and none left)
    joined: list[int] = field(default_factory=list)  # member ids of the replacements admitted
    recover_s: float = 0.0  # from the failed collective to the new group (the loop adds its redo)
    # waited_s: how long this rank waited in the failed collective (for a stopped rank: the detection)
    detail: dict[str, float] = field(default_factory=dict)

    def record(self, step: int) -> dict[str, Any]:
        """The entry of the run's `faults` list (summary.json): the change, and the step it happened at."""
        return {"step": step, **asdict(self), "recover_s": round(self.recover_s, 4)}


def first_line(cause: BaseException | str) -> str:
    """The first line of an error (or of a text), for one-line records and messages."""
    text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
    return text.strip().splitlines()[0] if text.strip() else ""
