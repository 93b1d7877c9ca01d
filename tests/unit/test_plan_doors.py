"""Both doors give one verdict (issue 44, part 3): every pair of lockstep/plan.py's RULES, set through
`lockstep train` (its flags, the plan it checks before launch) and through Python (a FitConfig as `fit`
plans it; a SyncPolicy for the pairs whose settings are engine knobs), runs, falls back or is refused as
the table says. Before, `--sync diloco --bucket-cap-mb 10` was refused by the launcher while
`SyncPolicy(sync="diloco", bucket_cap_mb=10)` was accepted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lockstep.engine import SyncPolicy
from lockstep.errors import ConfigError
from lockstep.jobs.cli import build_parser, plan_of, resolve_config
from lockstep.plan import ENGINE_KNOBS, RULES, Plan, Rule, Verdict
from lockstep.trainer.settings.config import FitConfig
from lockstep.trainer.settings.config import plan_of as fit_plan_of

WORLD = 2


def _fit_values(key: str) -> dict[str, Any]:
    """The FitConfig fields that turn the table's `key` on (live and max_restarts are the launch's)."""
    name, _, value = key.partition("=")
    numbers = {"bucket_cap_mb": 10.0, "grad_accum_steps": 2, "clip_grad_norm": 1.0}
    if name in numbers:
        return {name: value or numbers[name]}
    if value:
        return {name: value}
    return {name: True}


def _flags(key: str) -> list[str]:
    """`lockstep train`'s flags for the table's `key`."""
    if key == "live":
        return ["--min-world", "1"]
    if key == "max_restarts":
        return ["--max-restarts", "1"]
    ((name, value),) = _fit_values(key).items()
    return [f"--{name.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]


def _policy_values(key: str) -> dict[str, Any] | None:
    """The SyncPolicy fields for `key`, or None when the engine has no such knob (fit's own settings)."""
    name, _, value = key.partition("=")
    if name == "reduce_dtype":
        return {"reduce_dtype": torch.bfloat16}
    if name in ENGINE_KNOBS or name == "deterministic":
        return {name: True}
    if name == "sync":
        return {"sync": value}
    if name == "sync_dtype":
        return {"delta_dtype": value}
    if name == "bucket_cap_mb":
        return {"bucket_cap_mb": value or 10.0}
    return None


def _verdict(rule: Rule, plan: Plan | None) -> Verdict:
    if plan is None:
        return Verdict.REFUSED
    return Verdict.FALLS_BACK if rule in plan.fallbacks else Verdict.RUNS


def _through_the_launcher(rule: Rule) -> Verdict:
    argv = ["toy", "-n", str(WORLD), *_flags(rule.first), *_flags(rule.second)]
    args, rest = build_parser().parse_known_args(argv)
    try:
        return _verdict(rule, plan_of(args, resolve_config(args.job, None, rest, None)))
    except ConfigError:
        return Verdict.REFUSED


def _through_fit(rule: Rule) -> Verdict:
    values = {**_fit_values(rule.first), **_fit_values(rule.second)}
    live = bool(values.pop("live", False))
    values.pop("max_restarts", None)
    try:
        return _verdict(rule, fit_plan_of(FitConfig(**values), WORLD, live=live))
    except ConfigError:
        return Verdict.REFUSED


def _through_sync_policy(rule: Rule) -> Verdict | None:
    first, second = _policy_values(rule.first), _policy_values(rule.second)
    if first is None or second is None:
        return None
    try:
        return _verdict(rule, SyncPolicy(**first, **second).plan)
    except ConfigError:
        return Verdict.REFUSED


def _has_flags(rule: Rule) -> bool:
    return not {rule.first.partition("=")[0], rule.second.partition("=")[0]} & set(ENGINE_KNOBS)


@pytest.mark.parametrize("rule", RULES, ids=[f"{r.first} + {r.second}" for r in RULES])
def test_every_rule_gets_the_tables_verdict_through_every_door(rule: Rule) -> None:
    doors = {"SyncPolicy": _through_sync_policy(rule)}
    if _has_flags(rule):
        doors["lockstep train"] = _through_the_launcher(rule)
        if "max_restarts" not in (rule.first, rule.second):  # a launch setting fit does not see
            doors["fit"] = _through_fit(rule)
    seen = {door: verdict for door, verdict in doors.items() if verdict is not None}
    assert seen, f"no door sets {rule.first} with {rule.second}"
    assert set(seen.values()) == {rule.verdict}, (
        f"{rule.first} with {rule.second}: the table says {rule.verdict}, {seen}"
    )


def test_a_bucket_size_with_a_periodic_sync_is_refused_by_both_doors() -> None:
    with pytest.raises(ConfigError, match=r"^bucket_cap_mb=10\.0 does not apply with sync='diloco'"):
        SyncPolicy(sync="diloco", bucket_cap_mb=10.0)
    args, rest = build_parser().parse_known_args(["toy", "--sync", "diloco", "--bucket-cap-mb", "10"])
    with pytest.raises(ConfigError, match=r"^--bucket-cap-mb 10\.0 does not apply with --sync diloco"):
        plan_of(args, resolve_config(args.job, None, rest, None))
    assert SyncPolicy(sync="diloco").plan.fallbacks == ()  # torch's default cap is no setting of the user's
