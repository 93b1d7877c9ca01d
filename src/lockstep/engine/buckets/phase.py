"""The reducer's per-step phases as one enum, and the table of the changes between them that are legal.

A synced step goes IDLE -> ARMED -> REDUCING -> FINALIZING -> IDLE:

- ARMED: a synced forward ran (pre_forward, then prepare_for_backward in post_forward); the next backward
  that accumulates a gradient into `.grad` is reduced.
- REDUCING: the first gradient of that backward arrived (post_accumulate_grad): a StepState exists and
  buckets launch in order as they fill.
- FINALIZING: the autograd engine's callback at the end of that backward: missing gradients are filled
  in, the remaining buckets launched, the ranks agree on unused parameters, wait and write back.
- SHADOWING: inside join(), a rank that ran out of inputs mirrors a synced backward's collectives with
  zeros; afterwards it is back in the phase it came from.

The legal oddities, all kept from before the phases were explicit (torch's DDP behaves the same way):

- ARMED -> ARMED: a second synced forward before the backward re-arms; the last one wins.
- A pass that accumulates nothing (`torch.autograd.grad`) ends without a step: the reducer stays ARMED for
  the real backward. A backward while IDLE (no_sync, eval) accumulates locally: no transition at all.
- SHADOWING -> ARMED: a shadow step that raised (join()); the next synced forward starts afresh.
- A backward or finalize that raised leaves its step REDUCING or FINALIZING: its collectives may have been
  issued on some ranks and not on others. The next synced forward raises UsageError instead of arming,
  and so does every later one (torch's "Expected to have finished reduction in the prior iteration"):
  the replicas may differ, and an engine that went on would hide it.
- Any phase -> SHADOWING -> that phase: a rank may join with an armed forward whose backward never ran.

Everything else (a step without an armed forward, a finalize without a step, nested shadow steps) is a
bug in the engine, raised as InternalError naming both phases. The pre_forward bucket rebuild and the
static graph's first step are no phases: the rebuild happens in pre_forward, before the forward arms the
reducer, and a static graph's first step is an ordinary REDUCING step that defers its launches to
FINALIZING (StepState.defer).
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where the reducer is in a synced step (see the module docstring for the transitions)."""

    IDLE = "idle"
    ARMED = "armed"
    REDUCING = "reducing"
    FINALIZING = "finalizing"
    SHADOWING = "shadowing"

    # Identity hash, in C: Enum's own hashes the name in Python, and the reducer looks phases up in LEGAL
    # a few times per step (equality is identity for enum members, so the two agree).
    __hash__ = object.__hash__


IDLE, ARMED, REDUCING, FINALIZING, SHADOWING = Phase

LEGAL: dict[Phase, frozenset[Phase]] = {
    IDLE: frozenset({ARMED, SHADOWING}),
    ARMED: frozenset({ARMED, REDUCING, SHADOWING}),
    REDUCING: frozenset({FINALIZING, SHADOWING}),
    FINALIZING: frozenset({IDLE, SHADOWING}),
    SHADOWING: frozenset({IDLE, ARMED, REDUCING, FINALIZING}),
}


def illegal_message(current: Phase, new: Phase) -> str:
    """The InternalError's message for a change of phase that LEGAL does not allow."""
    return (
        f"lockstep bug: the reducer went from phase {current.name} to {new.name}, which its state machine "
        f"does not allow (from {current.name}: {', '.join(sorted(p.name for p in LEGAL[current]))}); "
        "please report it"
    )
