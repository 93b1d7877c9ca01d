"""runtime/membership/formation.py on real gloo: a member whose formation failed forms the next generation
with its peers.

torch names each default process group from a count that only destroying a formed group resets; a failed
init_process_group counts too. Member 0 fails to form generation 1 (its peer is not there yet), then both
form generation 2: without lockstep resetting the count before each formation, member 0 would name its group
"1" and member 1 "0", their rendezvous keys would differ, and every later formation would time out (the
stall that chaos seeds 20 and 47 of benchmarks/results/2026-11-29-chaos.md ended in).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lockstep.errors import MembershipChanged
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.formation import Formation
from lockstep.runtime.membership.phases import GenerationPhase
from lockstep.runtime.membership.records import Membership
from tests.helpers import start_members

GO = "test/member1-may-form"


class QuietHost:
    """The process around the group as a formation uses it: a hang timeout of 1 s bounds each formation."""

    def hang_timeout(self) -> float:
        return 1.0


def _formation(port: int, member: int, generation: int) -> Formation:
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    state = GroupState(store, Membership(generation, (0, 1), member), GenerationPhase.FORMING)
    state.see_changes()
    return Formation(state, QuietHost(), "gloo", timedelta(seconds=30), min_world=1)  # type: ignore[arg-type]


def _member(port: int, member: int, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    formation = _formation(port, member, generation=1 if member == 0 else 2)
    try:
        if member == 0:
            try:
                formation.form_group()  # member 1 is not there: this formation fails
                results.put((member, "generation 1 formed without its peer"))
                return
            except MembershipChanged:
                pass
            formation.state.store.set(GO, "1")
            formation.state.membership = Membership(2, (0, 1), 0)
        else:
            formation.state.store.wait([GO])
        formation.form_group()
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        results.put((member, f"formed, sum {tensor.item():g}"))
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001  reported to the test, which names it
        results.put((member, f"{type(exc).__name__}: {str(exc)[:300]}"))


@pytest.mark.timeout(90)
def test_a_member_whose_formation_failed_forms_the_next_generation_with_its_peers() -> None:
    _store, procs, results = start_members(_member, (0, 1))
    got = dict(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert got == {0: "formed, sum 2", 1: "formed, sum 2"}, got
    assert [proc.exitcode for proc in procs] == [0, 0]
