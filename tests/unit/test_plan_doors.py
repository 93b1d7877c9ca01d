"""Both doors give one verdict (issue 44, part 3): every pair of lockstep/plan.py's RULES, set through
`lockstep train` (its flags, the plan it checks before launch) and through Python (a FitConfig as `fit`
plans it; a SyncPolicy for the pairs whose settings are engine knobs), runs, falls back or is refused as
the table says. Before, `--sync diloco --bucket-cap-mb 10` was refused by the launcher while
`SyncPolicy(sync="diloco", bucket_cap_mb=10)` was accepted, and `--sync-dtype int8` ran with a note while
`SyncPolicy(delta_dtype="int8")` was refused. LiveLoop's pair (a ShardedOptimizer) goes through LiveLoop;
the two checks on values (VALUE_CHECKS) go through the launcher and fit (its plan and its batch cut); the
engine's overlapped optimizer asks the plan handed to it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from lockstep.data import MicroBatchSampler
from lockstep.engine import ShardedOptimizer, SyncPolicy
from lockstep.engine.optim.optimizer_steps import fallback_reason
from lockstep.errors import ConfigError
from lockstep.jobs.cli import build_parser, plan_of, resolve_config
from lockstep.plan import (
    ENGINE_KNOBS,
    PYTHON_ONLY,
    RULES,
    SETTINGS,
    VALUE_CHECKS,
    Plan,
    PlanRefused,
    Rule,
    RunSettings,
    Verdict,
    flag_of,
    flag_verdicts,
)
from lockstep.trainer.live.live_loop import LiveLoop
from lockstep.trainer.settings.config import FitConfig
from lockstep.trainer.settings.config import plan_of as fit_plan_of

WORLD = 2


def _fit_values(key: str) -> dict[str, Any]:
    """The FitConfig fields that turn the table's `key` on (live and max_restarts are the launch's)."""
    name, _, value = key.partition("=")
    numbers = {
        "bucket_cap_mb": 10.0,
        "grad_accum_steps": 2,
        "clip_grad_norm": 1.0,
        "sync_warmup": 2,
        "fragments": 2,
        "fragment_delay": 2,
    }
    if name in numbers:
        return {name: value or numbers[name]}
    if value:
        return {name: value}
    if name == "deterministic":  # with the global batch it needs (VALUE_CHECKS)
        return {name: True, "global_batch_size": 64}
    return {name: True}


def _flags(key: str) -> list[str]:
    """`lockstep train`'s flags for the table's `key`."""
    if key == "live":
        return ["--min-world", "1"]
    if key == "max_restarts":
        return ["--max-restarts", "1"]
    flags = []
    for name, value in _fit_values(key).items():
        flags += [
            f"--{name.replace('_', '-')}",
            str(value).lower() if isinstance(value, bool) else str(value),
        ]
    return flags


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
    if name == "sync_warmup":
        return {"warmup_steps": 2}
    if name in ("fragments", "fragment_delay"):
        return {name: 2}
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


def _live_loop_values(key: str) -> dict[str, Any] | None:
    """LiveLoop's arguments for `key`, or None when LiveLoop has no such setting."""
    if key == "live_loop":
        return {}
    if key == "shard_optimizer":  # its class is what LiveLoop checks (no process group needed for that)
        return {"optimizer": ShardedOptimizer.__new__(ShardedOptimizer)}
    if key == "deterministic":
        return {"deterministic": True}
    return None


def _through_live_loop(rule: Rule) -> Verdict | None:
    """LiveLoop's verdict, for the pairs of its own setting: every one is a refusal that LiveLoop makes
    before it joins the group (a pair it accepted would go on to need a process group)."""
    if "live_loop" not in (rule.first, rule.second):
        return None
    first, second = _live_loop_values(rule.first), _live_loop_values(rule.second)
    if first is None or second is None:
        return None
    model = nn.Linear(2, 1)
    arguments: dict[str, Any] = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1), **first, **second}
    sampler = MicroBatchSampler(range(8), 2, 2, num_replicas=1, rank=0)
    optimizer = arguments.pop("optimizer")
    try:
        LiveLoop(model, optimizer, sampler, **arguments)
    except ConfigError:
        return Verdict.REFUSED
    raise AssertionError(f"LiveLoop took {rule.first} with {rule.second}: this door cannot say more")


def _has_flags(rule: Rule) -> bool:
    return not {rule.first.partition("=")[0], rule.second.partition("=")[0]} & set(PYTHON_ONLY)


@pytest.mark.parametrize("rule", RULES, ids=[f"{r.first} + {r.second}" for r in RULES])
def test_every_rule_gets_the_tables_verdict_through_every_door(rule: Rule) -> None:
    doors = {"SyncPolicy": _through_sync_policy(rule), "LiveLoop": _through_live_loop(rule)}
    if _has_flags(rule):
        doors["lockstep train"] = _through_the_launcher(rule)
        if "max_restarts" not in (rule.first, rule.second):  # a launch setting fit does not see
            doors["fit"] = _through_fit(rule)
    seen = {door: verdict for door, verdict in doors.items() if verdict is not None}
    assert seen, f"no door sets {rule.first} with {rule.second}"
    assert set(seen.values()) == {rule.verdict}, (
        f"{rule.first} with {rule.second}: the table says {rule.verdict}, {seen}"
    )
    if "live_loop" in (rule.first, rule.second):  # the plan LiveLoop is to ask (trainer/live/live_loop.py)
        settings = RunSettings(live=True, live_loop=True, shard_optimizer=True)
        with pytest.raises(PlanRefused) as refused:
            Plan.of(settings)
        assert refused.value.rule is rule


# Each check on values, as the launcher's flags on WORLD ranks and as FitConfig's fields; refused or not.
VALUE_CASES = [
    ("deterministic without a global batch", ["--deterministic"], {"deterministic": True}, False, True),
    ("deterministic with one", ["--deterministic", "--global-batch-size", "64"],
     {"deterministic": True, "global_batch_size": 64}, False, False),
    ("float live mode, 1 micro-batch for 2 ranks", ["--global-batch-size", "4", "--micro-batch-size", "4"],
     {"global_batch_size": 4, "micro_batch_size": 4}, True, True),
    ("float live mode, 2 micro-batches for 2 ranks", ["--global-batch-size", "4", "--micro-batch-size", "2"],
     {"global_batch_size": 4, "micro_batch_size": 2}, True, False),
    ("float live mode, the default cut", [], {}, True, False),
    ("deterministic live mode, 1 micro-batch for 2 ranks",
     ["--deterministic", "--global-batch-size", "4", "--micro-batch-size", "4"],
     {"deterministic": True, "global_batch_size": 4, "micro_batch_size": 4}, True, False),
]  # fmt: skip


@pytest.mark.parametrize(
    "flags, fields, live, refused", [c[1:] for c in VALUE_CASES], ids=[c[0] for c in VALUE_CASES]
)
def test_every_value_check_gets_one_verdict_through_every_door(
    flags: list[str], fields: dict[str, Any], live: bool, refused: bool
) -> None:
    launch = ["--min-world", "1"] if live else []
    args, rest = build_parser().parse_known_args(["toy", "-n", str(WORLD), *launch, *flags])
    config = FitConfig(**fields)
    doors: dict[str, Any] = {
        "lockstep train": lambda: plan_of(args, resolve_config(args.job, None, rest, None)),
        "fit's plan": lambda: fit_plan_of(config, WORLD, live=live),
    }
    verdicts = {}
    for door, ask in doors.items():
        try:
            ask()
            verdicts[door] = False
        except ConfigError:
            verdicts[door] = True
    assert set(verdicts.values()) == {refused}, verdicts


def test_the_value_checks_say_what_to_do_at_each_door() -> None:
    args, rest = build_parser().parse_known_args(["toy", "-n", "2", "--deterministic"])
    with pytest.raises(PlanRefused, match=r"^--deterministic without --global-batch-size: ") as at_launch:
        plan_of(args, resolve_config(args.job, None, rest, None))
    with pytest.raises(PlanRefused, match=r"^deterministic=True without global_batch_size: ") as in_fit:
        fit_plan_of(FitConfig(deterministic=True), 2, live=False)
    assert at_launch.value.rule is in_fit.value.rule is VALUE_CHECKS[0]


def test_a_quantized_sync_dtype_with_all_reduce_falls_back_at_every_door() -> None:
    rule = next(r for r in RULES if (r.first, r.second) == ("sync_dtype=int8", "sync=allreduce"))
    assert rule.verdict is Verdict.FALLS_BACK
    assert SyncPolicy(delta_dtype="int8").plan.fallbacks == (rule,)
    assert fit_plan_of(FitConfig(sync_dtype="int8"), 2, live=False).fallbacks == (rule,)
    args, rest = build_parser().parse_known_args(["toy", "--sync-dtype", "int8"])
    assert plan_of(args, resolve_config(args.job, None, rest, None)).notes() == [
        "--sync-dtype int8 does not apply with --sync allreduce: a quantized dtype applies to a periodic sync's "
        "outer gradients only (diloco, streaming_diloco): the every-step all-reduce averages the gradients in fp32"
    ]


def test_the_engine_s_overlap_asks_the_plan_handed_to_it() -> None:
    sgd = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    for settings in (RunSettings(live=True), RunSettings(clip_grad_norm=1.0), RunSettings(precision="fp16")):
        plan = Plan.of(dataclasses.replace(settings, overlap_optimizer=True))
        rule = plan.fallback("overlap_optimizer")
        assert rule is not None and fallback_reason(sgd, plan) == rule.reason
    assert fallback_reason(sgd, Plan.of(RunSettings(overlap_optimizer=True, sync="allreduce"))) is None


def _help_lines() -> dict[str, str]:
    """`lockstep train --help`'s lines of the plan's section, by flag."""
    text = build_parser().format_help()
    section = text[text.index("Which settings do not combine") :].splitlines()[1:]
    return dict(line.strip().split(": ", 1) for line in section if line.startswith("  "))


def test_help_says_what_the_table_says_of_each_flag() -> None:
    lines = _help_lines()
    for setting in SETTINGS:
        if setting.key in PYTHON_ONLY:
            continue
        expected: dict[str, set[str]] = {}
        for rule in RULES:
            if setting.key in (rule.first, rule.second) and not {rule.first, rule.second} & set(PYTHON_ONLY):
                other = rule.second if rule.first == setting.key else rule.first
                expected.setdefault(rule.verdict.value, set()).add(flag_of(other))
        checks = [check.short for check in VALUE_CHECKS if check.key == setting.key]
        if not expected and not checks:
            assert flag_of(setting.key) not in lines
            continue
        shown: dict[str, set[str]] = {}
        for part in lines[flag_of(setting.key)].split("; "):
            verdict, _, others = part.partition(" with ")
            if others:
                shown[verdict] = set(others.split(", "))
            else:
                assert part.removeprefix("refused ") in checks, part
        assert shown == expected, setting.key


def test_the_min_world_help_comes_from_the_plan() -> None:
    parser = build_parser()
    action = next(a for a in parser._actions if "--min-world" in a.option_strings)
    assert action.help is not None and action.help.endswith(f"({flag_verdicts('live')})")
    words = " ".join(parser.format_help().split())
    assert "refused with --bucket-cap-mb auto, --sync-warmup N" in words
    assert "needs --deterministic" not in words and "needs --global-batch-size" not in words


def test_a_bucket_size_with_a_periodic_sync_is_refused_by_both_doors() -> None:
    with pytest.raises(ConfigError, match=r"^bucket_cap_mb=10\.0 does not apply with sync='diloco'"):
        SyncPolicy(sync="diloco", bucket_cap_mb=10.0)
    args, rest = build_parser().parse_known_args(["toy", "--sync", "diloco", "--bucket-cap-mb", "10"])
    with pytest.raises(ConfigError, match=r"^--bucket-cap-mb 10\.0 does not apply with --sync diloco"):
        plan_of(args, resolve_config(args.job, None, rest, None))
    assert SyncPolicy(sync="diloco").plan.fallbacks == ()  # torch's default cap is no setting of the user's
