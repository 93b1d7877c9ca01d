"""A step counts on every member or on none: each member counts itself done on the store before its
optimizer step, and one verdict on the store says whether the step counted.

A collective can complete on some ranks and fail on others (the dead rank sent its last bytes to some
peers only), so completion alone would let the members disagree on whether the step happened. A member
writes its key (`gen<g>/done/<step>/<member>`, answered by the store) before it can die, then waits until
every member's key is there ("commit") or the change counter moves first ("redo"). What each member saw
may differ: a member can see the counter move (a queued replacement died, a straggler was evicted) a
moment before the last key lands, which another member sees. So the first member to decide writes its
word as the step's verdict (`gen<g>/verdict/<step>`, compare_set: the first writer wins) and every member
follows the verdict, not what it saw. One store write, one compare_set and a read or two per step. A
member's metric rows of the step travel with its key (`.../rows`), so that after the step counted they
stay readable when the member is lost before the next log (rank 0 takes them over).

Work between steps that issues collectives (a log, an evaluation, a checkpoint) is agreed on the same way
(`commit(step, work=name)`): a member that completed a checkpoint's last collective must not go on to the
next step while another, whose copy of it failed, redoes the checkpoint (their collectives would mismatch);
so either every member completed the work, or every member redoes it.
"""

from __future__ import annotations

import time

from lockstep.errors import MembershipChanged
from lockstep.runtime.membership import keys
from lockstep.runtime.membership.core import GroupState
from lockstep.runtime.membership.host import Host
from lockstep.runtime.membership.phases import GenerationPhase

COMMIT, REDO = "commit", "redo"  # a step's verdict


class StepCommit:
    """This member's side of committing steps."""

    def __init__(self, state: GroupState, host: Host) -> None:
        self.state, self.host = state, host

    def commit(self, step: int, rows: bytes | None = None, *, work: str = "") -> None:
        """After this rank's collectives of `step` completed: return once every member's did (the step
        counts everywhere), or raise MembershipChanged on every member when one's did not (all redo it).
        `rows`: this member's metric rows of the step (packed), kept on the store with its key. `work`: the
        work between steps after `step` that completed, instead of the step (see the module doc)."""
        state = self.state
        m = state.membership
        label: int | str = f"{step}/{work}" if work else step
        state.phase.enter(GenerationPhase.COMMITTING)
        if rows is not None:
            state.store.set(keys.done_rows(m.generation, label, m.member_id), rows)  # before the add below
        state.store.add(keys.done(m.generation, label, m.member_id), 1)  # written before this rank can die
        done = [keys.done(m.generation, label, member) for member in m.members]
        # Waited on like a collective: a member stopped between its collectives and its key is judged by
        # the hang watchdog (its heartbeat), and evicted after the hang timeout like in any collective.
        with self.host.tracked(f"commit ({work or 'step'} {step})"):
            while True:
                if state.store.check(done):
                    seen = COMMIT
                    break
                if state.changed():
                    seen = COMMIT if state.store.check(done) else REDO
                    break
                time.sleep(0.0005)
            verdict = bytes(state.store.compare_set(keys.verdict(m.generation, label), "", seen)).decode()
        if verdict != COMMIT:
            what = f"the work after step {step} ({work})" if work else f"step {step}"
            raise MembershipChanged(
                f"{state.tag}a member left before {what} completed on every rank (generation "
                f"{m.generation}): it is redone"
            )
        state.phase.enter(GenerationPhase.TRAINING)

    def committed_rows(self, generation: int, step: int, member: int) -> bytes | None:
        """The metric rows that `member` committed with `step` in `generation`, if it did."""
        key = keys.done_rows(generation, step, member)
        store = self.state.store
        return bytes(store.get(key)) if store.check([key]) else None

    def forget_rows(self, committed: list[tuple[int, int]]) -> None:
        """Drop this member's rows of (step, generation) pairs once they are logged: the store stays small."""
        member = self.state.membership.member_id
        for step, generation in committed:
            self.state.store.delete_key(keys.done_rows(generation, step, member))
