"""The run's plan: which of a run's settings combine, decided once from one table, before any worker starts.

A run's modes come from a handful of settings (deterministic, live, the optimizer's overlap and sharding,
the sync mode and what it sends, its warm-up and fragments, the bucket size, accumulation, clipping,
precision, restarts, the engine's own knobs). Every pair of them either runs, falls back (one of the two
does not apply, and the run says why, once) or is refused (with what to do instead). That table is
plan_table.py's (`RULES`; a pair not in it runs; re-exported here); this module holds the plan built from
it for a run's settings (`RunSettings`, `Plan.of`) and asks the checks on values that no pair states
(plan_settings.py's `VALUE_CHECKS`: deterministic mode needs a global batch; float live mode needs a
micro-batch of every step per rank; shard_degree must divide the world size, sharded deterministic mode
needs the step's micro-batches in a multiple of the ranks, a periodic sync across sharded groups two groups
or more and no deterministic mode), and nothing else decides them. The engine's door, which has no
FitConfig, makes the shard layout's checks with `check_shard_layout(world_size, shard_degree)`. Each door
builds the plan once, from its own names, and hands it down:

- `lockstep train` (jobs/cli.py `plan_of`) builds it from the settings and the launch before starting a
  worker, so a refusal is one line and exit status 2, never a traceback per rank (`lockstep run` starts a
  program whose settings it does not know: the program's `fit` or SyncPolicy meets the refusal), and its
  --help says what each flag does not combine with from the same table (`flag_verdicts`);
- `lockstep.fit` (trainer/settings/config.py `plan_of`) builds it from its FitConfig and world;
- the native API: SyncPolicy builds it from its knobs (`SyncPolicy.plan`), and the replica's
  `overlap_optimizer` asks that plan, with the call's clipping and scaler added (or the plan fit passes);
  LiveLoop's own setting is `live_loop`.

The same setting gets the same verdict at every door (tests/unit/test_plan_doors.py sets every pair and
every value check through each).

docs/modes.md shows the table as `markdown_table()` writes it (a test keeps the two equal). Standard
library only: the launcher imports it without torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from lockstep.errors import ConfigError
from lockstep.plan_settings import (
    PLACEHOLDER_FACTS,
    SHARD_LAYOUT_CHECKS,
    VALUE_CHECKS,
    RunSettings,
    ValueCheck,
)
from lockstep.plan_table import (
    ENGINE_KNOBS,
    FRAGMENT_LAYOUTS,
    PYTHON_ONLY,
    QUANTIZED_SYNC_DTYPES,
    RULES,
    SETTINGS,
    SYNC_DTYPES,
    SYNC_KEYS,
    SYNC_MODES,
    UNFRAGMENTED_SYNC_KEYS,
    Reduction,
    Rule,
    Setting,
    Verdict,
    flag_of,
    rule_for,
)

# The table's names are re-exported: the doors read them from lockstep.plan.
__all__ = [
    "ENGINE_KNOBS",
    "FRAGMENT_LAYOUTS",
    "PYTHON_ONLY",
    "QUANTIZED_SYNC_DTYPES",
    "RULES",
    "SETTINGS",
    "SYNC_DTYPES",
    "SYNC_KEYS",
    "SYNC_MODES",
    "UNFRAGMENTED_SYNC_KEYS",
    "Reduction",
    "Rule",
    "Setting",
    "Verdict",
    "flag_of",
    "rule_for",
    "PlanRefused",
    "RunSettings",
    "ValueCheck",
    "VALUE_CHECKS",
    "Plan",
    "flag_verdicts",
    "markdown_table",
    "SHARD_LAYOUT_CHECKS",
    "check_shard_layout",
]


class PlanRefused(ConfigError):
    """Settings that do not combine: the message is one line naming them and what to do instead (`rule`: the
    table's pair, or the value check)."""

    def __init__(self, message: str, rule: Rule | ValueCheck) -> None:
        super().__init__(message)
        self.rule = rule


@dataclass(frozen=True)
class Plan:
    """A run's settings, checked against the table: the fallbacks that apply (a refusal raised when built)."""

    settings: RunSettings
    fallbacks: tuple[Rule, ...]

    @classmethod
    def of(cls, settings: RunSettings, *, flags: bool = False) -> Plan:
        """The plan, or PlanRefused for the first refused pair, else the first value check that refuses (its
        line spelled as flags, or as Python)."""
        fallbacks = []
        for first, second in itertools.combinations(settings.keys(), 2):
            rule = rule_for(first, second)
            if rule.verdict is Verdict.REFUSED:
                raise PlanRefused(rule.line(settings.facts(), flags=flags), rule)
            if rule.verdict is Verdict.FALLS_BACK:
                fallbacks.append(rule)
        for check in VALUE_CHECKS:
            if check.refuses(settings):
                raise PlanRefused(check.line(settings, flags=flags), check)
        return cls(settings, tuple(fallbacks))

    @property
    def reduction(self) -> Reduction:
        """The engine's mode: a periodic sync (deterministic or not), else exact sums in deterministic mode,
        else buckets."""
        if f"sync={self.settings.sync}" in SYNC_KEYS:
            return Reduction.PERIODIC
        return Reduction.EXACT if self.settings.deterministic else Reduction.BUCKETED

    def fallback(self, key: str) -> Rule | None:
        """The first fallback whose first setting is `key` (the one that does not apply), or None."""
        return next((r for r in self.fallbacks if r.first == key), None)

    def notes(self, *, flags: bool = True) -> list[str]:
        """One line per fallback, for the launcher to print once."""
        return [rule.line(self.settings.facts(), flags=flags) for rule in self.fallbacks]


def flag_verdicts(key: str) -> str:
    """What the table says of the setting `key` against the others, as `lockstep train --help` shows it:
    "refused with --sync diloco, ...; falls back with ...; refused ..." ('' where every pair runs)."""
    parts = []
    for verdict in (Verdict.REFUSED, Verdict.FALLS_BACK):
        others = [
            flag_of(r.second if r.first == key else r.first)
            for r in RULES
            if r.verdict is verdict
            and key in (r.first, r.second)
            and not {r.first, r.second} & set(PYTHON_ONLY)
        ]
        if others:
            parts.append(f"{verdict.value} with {', '.join(dict.fromkeys(others))}")
    parts += [f"refused {check.short}" for check in VALUE_CHECKS if check.key == key]
    return "; ".join(parts)


def markdown_table() -> str:
    """The compatibility table as docs/modes.md shows it: every pair that does not simply run."""
    rows = ["| settings | verdict | why | instead |", "|---|---|---|---|"]
    for rule in RULES:
        first, second = flag_of(rule.first), flag_of(rule.second)
        pair = f"`{first}` {rule.joined} `{second}`"
        rows.append(f"| {pair} | {rule.verdict.value} | {rule.reason} | {rule.instead or '-'} |")
    for check in VALUE_CHECKS:  # the checks on values, after the pairs
        case = check.flag.format(**PLACEHOLDER_FACTS)
        instead = check.instead_flag.format(**PLACEHOLDER_FACTS)
        rows.append(f"| `{case}` | {Verdict.REFUSED.value} | {check.reason} | {instead} |")
    return "\n".join(rows) + "\n"


def check_shard_layout(world_size: int, shard_degree: int) -> None:
    """The shard layout's checks at a door without a FitConfig (the engine's): PlanRefused, spelled as Python,
    where `shard_degree` ranks per shard group do not make a whole number of groups of `world_size` ranks
    (the checks every other door makes in `Plan.of`); ConfigError for a count below 1."""
    for name, value in (("world_size", world_size), ("shard_degree", shard_degree)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected an int >= 1")
    settings = RunSettings(world_size=world_size, shard_degree=shard_degree)
    for check in SHARD_LAYOUT_CHECKS:
        if check.refuses(settings):
            raise PlanRefused(check.line(settings, flags=False), check)
