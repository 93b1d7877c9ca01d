"""Live mode is one part of the trainer (issue 44, part 2): outside trainer/live/, at most 3 trainer modules
name it in their code (an identifier with the word "live": `FitLive`, `live_side`, `LIVE`; comments and
strings do not count), and the live-or-not choice is made once, as an object (trainer/live/live_side.py).
"""

from __future__ import annotations

import io
import re
import tokenize

from lockstep.trainer.live.live_side import FitLive, FitLiveRounds, NotLive
from tests.structure import SRC

TRAINER = SRC / "trainer"
MAX_MODULES_NAMING_LIVE = 3  # the package's face (LiveLoop), the loop that holds the part, fit's settings


def words(identifier: str) -> list[str]:
    """An identifier's words: split at underscores and at case changes (`FitLive` -> fit, live)."""
    found = []
    for part in identifier.split("_"):
        found += re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", part)
    return [word.lower() for word in found]


def live_identifiers(source: str) -> list[str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t.string for t in tokens if t.type == tokenize.NAME and "live" in words(t.string)]


def modules_naming_live() -> dict[str, list[str]]:
    named = {}
    for path in sorted(TRAINER.rglob("*.py")):
        relative = path.relative_to(TRAINER)
        if relative.parts[0] == "live":
            continue
        found = live_identifiers(path.read_text())
        if found:
            named[str(relative)] = sorted(set(found))
    return named


def test_the_word_finder_sees_live_in_identifiers_only() -> None:
    assert words("FitLiveRounds") == ["fit", "live", "rounds"]
    assert words("LIVE") == ["live"] and words("live_side") == ["live", "side"]
    source = 'x = alive + deliver  # live\ny = "live"\nz = FitLive(live_world)\n'
    assert live_identifiers(source) == ["FitLive", "live_world"]


def test_at_most_three_trainer_modules_outside_live_mode_name_it() -> None:
    named = modules_naming_live()
    assert len(named) <= MAX_MODULES_NAMING_LIVE, named
    assert not any(path.startswith("run/") for path in named), named  # the run's parts know no mode


def test_the_choice_is_one_object_with_one_face() -> None:
    """The loop asks its side without knowing which it holds: both sides offer the same methods."""
    public = {name for name in dir(NotLive) if not name.startswith("_") and callable(getattr(NotLive, name))}
    assert {"attach", "batch_plan", "sharded", "commit_step", "after_step", "logged"} <= public
    for side in (FitLive, FitLiveRounds):
        missing = public - set(dir(side))
        assert not missing, f"{side.__name__} lacks {sorted(missing)}"
