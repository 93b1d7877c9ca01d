"""Live mode for a low-communication run (FitConfig.sync): the round counts on every member or on none.

Between outer syncs nothing is communicated, so a lost member's inner steps exist only in its own
process, and its samples of the round only in its own parameters: they cannot be taken over. The
survivors therefore go back to the round's start (the last outer sync, where every replica was equal
and the outer state was agreed) and redo the round's steps over themselves: every sample of the round
is trained on again, on the new world size, and the lost member's partial round leaves no trace in the
final model. That is live mode's "redo the interrupted step" with the round as the step.

- `LiveRounds.mark()` keeps, in host memory, everything a redo needs on this rank (a `RoundMark`): the
  model, the inner optimizer, schedule, scaler, sampler, counters, record, pending metrics, the outer
  state (anchor, outer momentum) and the random generators. It is taken at the start of the run and
  after each round boundary's commit (`commit()`: membership/commit.py, so that every member or none
  counts the round; only then does any member replace its mark).
- On a change of members, `discard()` (the run's `Recoverable.discard_step`) arms the rollback; the
  replica rebuilt on the new group then gets the mark back (`rebuilt()`) before the members compare
  their marks, so that they all stand at the mark's step. The loop raises `RolledBack` and carries on
  from there. A growth (replacements admitted at a round boundary) goes back nowhere: the new replica
  only gets the outer state, and the replacements receive the run's state from rank 0.

Streaming DiLoCo (`fragments` given) never has every replica equal: each fragment syncs at its own
step, and its outer step is merged into local values that moved on. Its marks are taken at every
fragment's sync (the step that launches a fragment's mean, once committed), and a rollback goes back to
the last one: each survivor to its own state there, the outer state (anchors, outer momentum) the same on
all. A mean still in flight at the mark is kept as this rank's contribution (`sync_state_dict(wait=False)`)
and sent again over the survivors when it is due. What only the lost member held is dropped: its inner
progress on each fragment since that fragment's last sync (the steps of `dropped_steps`); its samples
there were trained once, by it, and are not trained again (the sampler's order and the sync schedule
are functions of the step: re-queuing them would shift both). They are counted in the fault's record
(`dropped`: the members, the steps and the number of samples). A replacement joins at a round's end
(the last fragment's sync), after that fragment's mean is back (`settle`), so that it takes the same
outer state as the members.

Work that a round's steps did between its syncs (logs, evaluations, checkpoints mid-round) is redone
too: the metric log on rank 0 is cut back to what it held at the mark. A lost member's metric rows not
yet logged at the mark are not recovered (the logged means of that interval cover the survivors' samples
only); what is trained is unaffected.
"""

from __future__ import annotations

from typing import Any

from lockstep.engine.periodic.outer_sync import due_fragments, in_flight_entries
from lockstep.errors import LockstepError
from lockstep.runtime.membership.group import LiveGroup
from lockstep.runtime.micro_batches import owned_micro_batches
from lockstep.runtime.run_account import ACCOUNT, Point
from lockstep.trainer.run.registry import Use
from lockstep.trainer.run.run_state import RunState


class RoundMark:
    """This rank's state at a round boundary (or at the run's start), kept in memory for a redo: the
    run's registry's entries of a mark (trainer/run/registry.py), copied to the host."""

    def __init__(
        self,
        state: RunState,
        *,
        sync_every: int,
        streaming: bool,
        log_count: int | None,
        members: tuple[int, ...] = (),
    ) -> None:
        self.step = state.counters.step
        self.log_count = log_count  # rank 0: the metric log's records at the mark
        self.members = members  # the group's member ids when the mark was taken
        self.tree = state.registry.snapshot(Use.MARK, host=True)
        # a point a redo can start from (not a diloco resume mid-round; streaming's marks are all points)
        self.boundary = streaming or int(self.outer["inner_steps"]) % sync_every == 0

    @property
    def outer(self) -> dict[str, Any]:
        """The outer sync state at the mark (streaming: a mean in flight kept as this rank's contribution)."""
        return dict(self.tree["outer"])

    def restore(self, state: RunState) -> None:
        """Put this rank back where it stood at the mark (copies: the mark may be restored again). The
        loads move each tensor to its parameter's device."""
        state.registry.restore(self.tree, Use.MARK, copied=True)


class LiveRounds:
    """fit's rounds in live mode (see the module doc)."""

    def __init__(
        self, group: LiveGroup, state: RunState, sync_every: int, *, fragments: int | None = None
    ) -> None:
        self.group, self.state, self.sync_every = group, state, sync_every
        self.fragments = fragments  # streaming DiLoCo: marks at every fragment's sync (module doc)
        self.last: RoundMark | None = None
        self.marked_at: Point | None = None  # when the mark was taken: a rollback discards the work since
        self.dropped: dict[str, Any] | None = None  # streaming: what the last rollback dropped
        self.armed = False  # a change of members happened: the rebuilt replica gets the mark back
        self.closed = False  # the run ended (its last barrier): nothing is redone any more

    @property
    def active(self) -> bool:
        return self.last is not None and not self.closed

    def mark(self, log_count: int | None) -> None:
        """Keep this rank's state as the point a redo starts from (streaming: without waiting for the
        fragment's mean in flight; its contribution is kept instead: the run's `outer` entry)."""
        self.marked_at = ACCOUNT.point()
        self.last = RoundMark(
            self.state,
            sync_every=self.sync_every,
            streaming=self.fragments is not None,
            log_count=log_count,
            members=self.group.membership.members,
        )

    def round_end(self, step: int) -> bool:
        """After `step`: a round's end, where replacements may join (streaming: its last fragment's sync)."""
        return step % self.sync_every == 0

    def settle(self, handle: Any, step: int) -> None:
        """Streaming, at a round's end, before its commit: wait for the fragment's mean in flight when a
        replacement joins now (it takes the mean, the same as the members'), and always with one fragment
        (whose next collective is no proof that rank 0 planned the growth: admission.py)."""
        if self.fragments is None or not self.round_end(step):
            return
        if self.fragments == 1 or self.group.joiners_due(step, step + self.sync_every):
            handle.sync_state_dict()  # waits: the mean stays pending, now back

    def commit(self, step: int) -> None:
        """At a round boundary (its sync done): return once every member's sync did, or raise
        MembershipChanged on every member (membership/commit.py); only then is a new mark taken."""
        self.group.commit(step)

    def discard(self) -> None:
        """A member was lost: go back to the mark on the group being formed (see rebuilt())."""
        last = self.last
        if not self.active or last is None:
            return
        if not last.boundary:  # diloco / local SGD resumed mid-round (streaming's marks are all points)
            raise LockstepError(
                f"{self.group.state.tag}a member was lost in the round this run resumed in the middle of "
                f"(step {last.step}): its inner steps before the resume exist only in its own state, so the "
                "round cannot be redone without it; resume from the last checkpoint (at that world size)"
            )
        self.armed = True

    def rebuilt(self) -> None:
        """The replica was rebuilt on a new group: after a loss, this rank's state from the mark; after a
        growth, the outer state carried over (the replicas stand at the boundary the mark was taken)."""
        last = self.last
        if last is None:
            return
        if self.armed and not self.closed:
            last.restore(self.state)
            self.armed = False
            self.dropped = self._dropped(last)
        else:
            self.state.registry.restore(last.tree, Use.MARK, keys=("outer",))

    def _dropped(self, last: RoundMark) -> dict[str, Any] | None:
        """Streaming, after a rollback to `last`: the lost members, the steps whose inner progress of
        theirs some fragment's agreed outer steps lack, and their samples in those steps."""
        count = self.fragments
        lost = [m for m in last.members if m not in self.group.membership.members]
        if count is None or not lost:
            return None
        unsent = {  # the fragments whose mean in flight is this rank's contribution only: launched after
            int(saved["fragment"]): int(saved["launched"])  # that step, not agreed by every member
            for saved in in_flight_entries(last.outer, last.step)
            if "contribution" in saved
        }
        starts = []
        for f in range(count):  # each fragment's last sync that every survivor applied (or holds the mean of)
            s = unsent[f] - 1 if f in unsent else last.step
            while s > 0 and f not in due_fragments(s, self.sync_every, count):
                s -= 1
            starts.append(s)
        first = min(starts) + 1
        sampler = self.state.sampler
        world = len(last.members)
        per_step = sum(
            len(owned_micro_batches(sampler.num_micro_batches, world, last.members.index(m))) for m in lost
        )
        steps = max(0, last.step - first + 1)
        return {
            "members": lost,
            "steps": [first, last.step] if steps else [],
            "samples": steps * per_step * sampler.micro_batch_size,
        }

    def rewind_log(self, runlog: Any) -> None:
        """After a rollback on rank 0: the metric log as it was at the mark."""
        last = self.last
        if last is None or not runlog.enabled:
            return
        if last.log_count is not None:
            runlog.truncate(last.log_count)
        else:  # this process became rank 0 after the mark: keep what the old rank 0 logged up to it
            runlog.rewind(last.step)
