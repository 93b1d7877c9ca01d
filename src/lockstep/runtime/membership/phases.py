"""The life of a live generation as a state machine: one enum, its legal transitions, asserted.

```
JOINING    -> FORMING      a replacement was admitted to a generation
FORMING    -> TRAINING     the generation's group formed (generation 0 retries inside FORMING until it does)
FORMING    -> LOST         a replacement's admitted generation failed to form (a member died): it re-forms
TRAINING   -> COMMITTING   this member's collectives of a step completed (membership.commit)
COMMITTING -> TRAINING     every member counted the step done: it counts everywhere
TRAINING   -> ADMITTING    a growth is due at this step boundary: re-form with the replacements appended
TRAINING   -> LOST         a collective failed, or a wait saw the member count change
COMMITTING -> LOST         a member left before every member counted the step done
ADMITTING  -> LOST         a member or a replacement died during the growth
REFORMING  -> LOST         a member died while the next group formed: agree and form again without it
LOST       -> REFORMING    the survivors leave the broken group and agree on who is left
REFORMING  -> TRAINING     the next generation's group formed
ADMITTING  -> TRAINING     the grown generation's group formed
```

docs/live.md draws the same machine with the store keys each phase reads and writes.

A transition not in `LEGAL` is a bug of lockstep's: InternalError naming both phases.
"""

from __future__ import annotations

import enum

from lockstep.errors import InternalError


class GenerationPhase(enum.Enum):
    JOINING = "joining"
    FORMING = "forming"
    TRAINING = "training"
    COMMITTING = "committing"
    LOST = "member lost"
    REFORMING = "re-forming"
    ADMITTING = "admitting"


P = GenerationPhase
LEGAL: dict[GenerationPhase, frozenset[GenerationPhase]] = {
    P.JOINING: frozenset({P.FORMING}),
    P.FORMING: frozenset({P.TRAINING, P.LOST}),
    P.TRAINING: frozenset({P.COMMITTING, P.LOST, P.ADMITTING}),
    P.COMMITTING: frozenset({P.TRAINING, P.LOST}),
    P.LOST: frozenset({P.REFORMING}),
    P.REFORMING: frozenset({P.TRAINING, P.LOST}),
    P.ADMITTING: frozenset({P.TRAINING, P.LOST}),
}


class PhaseMachine:
    """The current phase of this process's live generation; every change goes through `enter`."""

    def __init__(self, start: GenerationPhase) -> None:
        self.phase = start

    def enter(self, new: GenerationPhase) -> None:
        if new not in LEGAL[self.phase]:
            raise InternalError(
                f"live membership went from phase {self.phase.value!r} to {new.value!r}, which its state "
                "machine does not allow (runtime/membership/phases.py): a bug in lockstep"
            )
        self.phase = new
