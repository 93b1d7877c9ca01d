"""Both doors give one verdict (issue 44, part 3): every pair of lockstep/plan.py's RULES, set through
`lockstep train` (its flags, the plan it checks before launch) and through Python (a FitConfig as `fit`
plans it; a SyncPolicy for the pairs whose settings are engine knobs), runs, falls back or is refused as
the table says. Before, `--sync diloco --bucket-cap-mb 10` was refused by the launcher while
`SyncPolicy(sync="diloco", bucket_cap_mb=10)` was accepted, and `--sync-dtype int8` ran with a note while
`SyncPolicy(delta_dtype="int8")` was refused. LiveLoop's pair (a ShardedOptimizer) goes through LiveLoop;
the checks on values (VALUE_CHECKS) go through the launcher and fit (its plan and its batch cut); the
engine's overlapped optimizer asks the plan handed to it. Sharding the model (shard_degree, issue 45) meets
the engine's knobs and LiveLoop at the engine's door, which asks the plan of its own RunSettings (and makes
the shard layout's checks with check_shard_layout)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
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
    SHARD_LAYOUT_CHECKS,
    VALUE_CHECKS,
    Plan,
    PlanRefused,
    Rule,
    RunSettings,
    Verdict,
    check_shard_layout,
    flag_of,
    flag_verdicts,
)
from lockstep.plan_settings import survivable_multiple
from lockstep.trainer.live.live_loop import LiveLoop
from lockstep.trainer.settings.config import FitConfig
from lockstep.trainer.settings.config import plan_of as fit_plan_of

WORLD = 2
ROOT = Path(__file__).resolve().parents[2]


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
        "shard_degree": WORLD,  # FSDP over the test's world (a divisor of it: VALUE_CHECKS)
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


def _run_settings_values(key: str) -> dict[str, Any]:
    """RunSettings' fields for `key` (the engine's door: it has no FitConfig)."""
    name, _, value = key.partition("=")
    if name == "reduce_dtype":
        return {"reduce_dtype": torch.bfloat16}
    if name == "shard_degree":
        return {"shard_degree": WORLD, "world_size": WORLD}
    return {name: True}


def _through_the_engine_plan(rule: Rule) -> Verdict | None:
    """The sharded engine's door for its pairs with the engine's knobs and LiveLoop (no flag, no FitConfig
    sets them): the plan of its RunSettings, which the engine side asks as SyncPolicy asks its own."""
    keys = {rule.first, rule.second}
    if "shard_degree" not in keys or not keys & set(PYTHON_ONLY):
        return None
    try:
        settings = RunSettings(**_run_settings_values(rule.first), **_run_settings_values(rule.second))
        return _verdict(rule, Plan.of(settings))
    except ConfigError:
        return Verdict.REFUSED


def _has_flags(rule: Rule) -> bool:
    return not {rule.first.partition("=")[0], rule.second.partition("=")[0]} & set(PYTHON_ONLY)


@pytest.mark.parametrize("rule", RULES, ids=[f"{r.first} + {r.second}" for r in RULES])
def test_every_rule_gets_the_tables_verdict_through_every_door(rule: Rule) -> None:
    doors = {
        "SyncPolicy": _through_sync_policy(rule),
        "LiveLoop": _through_live_loop(rule),
        "the sharded engine's plan": _through_the_engine_plan(rule),
    }
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
        other = rule.second if rule.first == "live_loop" else rule.first
        settings = RunSettings(live=other != "shard_degree", live_loop=True, **_run_settings_values(other))
        with pytest.raises(PlanRefused) as refused:
            Plan.of(settings)
        assert refused.value.rule is rule


# Each check on values, as the launcher's flags on `world` ranks and as FitConfig's fields; refused or not.
VALUE_CASES = [
    ("deterministic without a global batch", ["--deterministic"], {"deterministic": True}, False, WORLD, True),
    ("deterministic with one", ["--deterministic", "--global-batch-size", "64"],
     {"deterministic": True, "global_batch_size": 64}, False, WORLD, False),
    ("float live mode, 1 micro-batch for 2 ranks", ["--global-batch-size", "4", "--micro-batch-size", "4"],
     {"global_batch_size": 4, "micro_batch_size": 4}, True, WORLD, True),
    ("float live mode, 2 micro-batches for 2 ranks", ["--global-batch-size", "4", "--micro-batch-size", "2"],
     {"global_batch_size": 4, "micro_batch_size": 2}, True, WORLD, False),
    ("float live mode, the default cut", [], {}, True, WORLD, False),
    ("deterministic live mode, 1 micro-batch for 2 ranks",
     ["--deterministic", "--global-batch-size", "4", "--micro-batch-size", "4"],
     {"deterministic": True, "global_batch_size": 4, "micro_batch_size": 4}, True, WORLD, False),
    # the shard layout: shard groups of shard_degree ranks, a whole number of them in the world
    ("shard degree 3 on 4 ranks", ["--shard-degree", "3"], {"shard_degree": 3}, False, 4, True),
    ("shard degree 4 on 2 ranks", ["--shard-degree", "4"], {"shard_degree": 4}, False, 2, True),
    ("shard degree 2 on 4 ranks (HSDP)", ["--shard-degree", "2"], {"shard_degree": 2}, False, 4, False),
    ("shard degree 4 on 4 ranks (FSDP)", ["--shard-degree", "4"], {"shard_degree": 4}, False, 4, False),
    ("shard degree 1 on 3 ranks (replicated)", ["--shard-degree", "1"], {"shard_degree": 1}, False, 3, False),
    # sharded deterministic mode: the step's micro-batches in a multiple of the ranks
    ("sharded deterministic, 3 micro-batches for 2 ranks",
     ["--shard-degree", "2", "--deterministic", "--global-batch-size", "6", "--micro-batch-size", "2"],
     {"shard_degree": 2, "deterministic": True, "global_batch_size": 6, "micro_batch_size": 2}, False, 2, True),
    ("sharded deterministic, 2 micro-batches for 2 ranks",
     ["--shard-degree", "2", "--deterministic", "--global-batch-size", "6", "--micro-batch-size", "3"],
     {"shard_degree": 2, "deterministic": True, "global_batch_size": 6, "micro_batch_size": 3}, False, 2, False),
    ("sharded deterministic (HSDP), 6 micro-batches for 4 ranks",
     ["--shard-degree", "2", "--deterministic", "--global-batch-size", "12", "--micro-batch-size", "2"],
     {"shard_degree": 2, "deterministic": True, "global_batch_size": 12, "micro_batch_size": 2}, False, 4, True),
    ("sharded deterministic, the default micro-batch (batch_size 32: 2 of them) on 2 ranks",
     ["--shard-degree", "2", "--deterministic", "--global-batch-size", "64"],
     {"shard_degree": 2, "deterministic": True, "global_batch_size": 64}, False, 2, False),
    ("unsharded deterministic, 3 micro-batches for 2 ranks",
     ["--deterministic", "--global-batch-size", "6", "--micro-batch-size", "2"],
     {"deterministic": True, "global_batch_size": 6, "micro_batch_size": 2}, False, 2, False),
]  # fmt: skip


@pytest.mark.parametrize(
    "flags, fields, live, world, refused", [c[1:] for c in VALUE_CASES], ids=[c[0] for c in VALUE_CASES]
)
def test_every_value_check_gets_one_verdict_through_every_door(
    flags: list[str], fields: dict[str, Any], live: bool, world: int, refused: bool
) -> None:
    launch = ["--min-world", "1"] if live else []
    args, rest = build_parser().parse_known_args(["toy", "-n", str(world), *launch, *flags])
    config = FitConfig(**fields)
    doors: dict[str, Any] = {
        "lockstep train": lambda: plan_of(args, resolve_config(args.job, None, rest, None)),
        "fit's plan": lambda: fit_plan_of(config, world, live=live),
    }
    if set(fields) == {"shard_degree"}:  # the engine's door: the layout alone, without a FitConfig
        doors["check_shard_layout"] = lambda: check_shard_layout(world, fields["shard_degree"])
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


def _launcher_plan(argv: list[str]) -> Plan:
    args, rest = build_parser().parse_known_args(argv)
    return plan_of(args, resolve_config(args.job, None, rest, None))


def test_the_shard_layout_checks_say_what_to_do_at_each_door() -> None:
    divides, larger = SHARD_LAYOUT_CHECKS[1], SHARD_LAYOUT_CHECKS[0]
    fix = "the world must be a whole number of shard groups; use a divisor of 4 (1, 2, 4)"
    with pytest.raises(PlanRefused) as at_launch:
        _launcher_plan(["toy", "-n", "4", "--shard-degree", "3"])
    assert str(at_launch.value) == f"--shard-degree 3 does not divide the world size 4 (-n 4): {fix}"
    with pytest.raises(PlanRefused) as in_fit:
        fit_plan_of(FitConfig(shard_degree=3), 4, live=False)
    assert str(in_fit.value) == f"shard_degree=3 does not divide the world size 4: {fix}"
    with pytest.raises(PlanRefused) as at_the_engine:
        check_shard_layout(4, 3)
    assert str(at_the_engine.value) == str(in_fit.value)
    assert at_launch.value.rule is in_fit.value.rule is at_the_engine.value.rule is divides

    with pytest.raises(PlanRefused) as at_launch:
        _launcher_plan(["toy", "-n", "2", "--shard-degree", "4"])
    assert str(at_launch.value) == (
        "--shard-degree 4 is larger than the world size 2 (-n 2): a shard group is made of the run's ranks; "
        "use a divisor of 2 (1, 2), or launch more ranks"
    )
    with pytest.raises(PlanRefused, match=r"^shard_degree=4 is larger than the world size 2: ") as in_fit:
        fit_plan_of(FitConfig(shard_degree=4), 2, live=False)
    with pytest.raises(PlanRefused, match=r"^shard_degree=4 is larger than the world size 2: ") as engine:
        check_shard_layout(2, 4)
    assert at_launch.value.rule is in_fit.value.rule is engine.value.rule is larger
    check_shard_layout(4, 2)  # HSDP: 2 replica groups of 2 shards
    check_shard_layout(4, 4)  # FSDP
    check_shard_layout(1, 1)
    for world, degree in ((4, 0), (0, 1), (4, True)):
        with pytest.raises(ConfigError, match=r"=(0|True): expected an int >= 1$"):
            check_shard_layout(world, degree)  # type: ignore[arg-type]


def test_sharded_deterministic_mode_says_what_to_do_at_each_door() -> None:
    cut = ["--deterministic", "--global-batch-size", "6", "--micro-batch-size", "2"]
    with pytest.raises(PlanRefused) as at_launch:
        _launcher_plan(["toy", "-n", "2", "--shard-degree", "2", *cut])
    assert str(at_launch.value) == (
        "--shard-degree 2 and --deterministic on 2 ranks, 3 micro-batches of 2 in a step of 6 samples: every "
        "rank joins every micro-batch's reduce-scatter, so every rank must compute as many micro-batches as the "
        "others: the step's micro-batches must be a multiple of the ranks; make them a multiple of 2, e.g. "
        "--global-batch-size 8 --micro-batch-size 2, or leave --shard-degree at 1"
    )
    config = FitConfig(shard_degree=2, deterministic=True, global_batch_size=6, micro_batch_size=2)
    with pytest.raises(PlanRefused) as in_fit:
        fit_plan_of(config, 2, live=False)
    assert str(in_fit.value).startswith(
        "shard_degree=2 and deterministic=True on 2 ranks, 3 micro-batches of 2 in a step of 6 samples: "
    )
    assert str(in_fit.value).endswith(
        "; make them a multiple of 2, e.g. global_batch_size=8, micro_batch_size=2, or leave shard_degree at 1"
    )
    uneven = next(c for c in VALUE_CHECKS if c.refuses.__name__ == "_uneven_sharded_micro_batches")
    assert at_launch.value.rule is in_fit.value.rule is uneven
    # what it suggests runs
    fit_plan_of(dataclasses.replace(config, global_batch_size=8), 2, live=False)
    _launcher_plan(["toy", "-n", "2", "--shard-degree", "2", *cut[:2], "8", *cut[3:]])


# A pair with shard_degree as each door spells it: the launcher's line (flags), fit's (Python).
SHARD_PAIRS = [
    (["--shard-optimizer", "true"], {"shard_optimizer": True}, False,
     "--shard-degree 2 with --shard-optimizer true: FSDP shards the optimizer's state with the parameters "
     "already (each rank steps its own shards); choose one of the two",
     "shard_degree=2 with shard_optimizer=True: FSDP shards"),
    (["--sync", "diloco"], {"sync": "diloco"}, False,
     "--shard-degree 2 with --sync diloco on 2 ranks: a periodic sync is one of replica groups meeting every "
     "few steps, and a shard degree of the whole world makes one group (FSDP), with no other to meet; use a "
     "shard degree that makes two groups or more (HSDP), e.g. --shard-degree 1, or sync every step",
     "shard_degree=2 with sync='diloco' on 2 ranks: a periodic sync is one of replica groups"),
    (["--sync", "streaming_diloco", "--fragments", "2"], {"sync": "streaming_diloco", "fragments": 2}, False,
     "--shard-degree 2 with --sync streaming_diloco on 2 ranks: a periodic sync is one of replica groups",
     "shard_degree=2 with sync='streaming_diloco' on 2 ranks: "),
    (["--sync", "diloco", "--sync-warmup", "2"], {"sync": "diloco", "sync_warmup": 2}, False,
     "--sync-warmup 2 does not apply with --shard-degree 2: a warm-up averages whole gradients before the "
     "rounds start, and a sharded run's outer sync holds its local shards alone (not built); leave "
     "sync_warmup at 0",
     "sync_warmup=2 does not apply with shard_degree=2: "),
    (["--precision", "fp16"], {"precision": "fp16"}, False,
     "--precision fp16 with --shard-degree 2: a GradScaler over sharded gradients is not wired; use precision "
     "bf16 (no scaler), or leave shard_degree at 1",
     "precision='fp16' with shard_degree=2: a GradScaler over sharded gradients is not wired; use precision bf16"),
]  # fmt: skip


@pytest.mark.parametrize(
    "flags, fields, live, at_launch, in_fit", SHARD_PAIRS, ids=[" ".join(p[0]) for p in SHARD_PAIRS]
)
def test_a_refused_pair_with_shard_degree_says_both_and_what_to_do_at_each_door(
    flags: list[str], fields: dict[str, Any], live: bool, at_launch: str, in_fit: str
) -> None:
    with pytest.raises(PlanRefused) as launcher:
        _launcher_plan(["toy", "-n", "2", "--shard-degree", "2", *flags])
    assert str(launcher.value).startswith(at_launch) and "\n" not in str(launcher.value)
    with pytest.raises(PlanRefused) as fit:
        fit_plan_of(FitConfig(shard_degree=2, **fields), 2, live=live)
    assert str(fit.value).startswith(in_fit)
    assert launcher.value.rule is fit.value.rule


def test_live_mode_across_sharded_groups_wants_micro_batches_even_over_every_world_left() -> None:
    """4 ranks as 2 groups of 2: a loss leaves 2, so a step's micro-batches must be a multiple of 4 and of 2;
    on 6 ranks as 3 groups (worlds 6, 4, 2) of 12. What each door suggests runs; a periodic sync is refused."""
    cut = ["--deterministic", "--global-batch-size", "12", "--micro-batch-size", "2"]  # 6 micro-batches
    _launcher_plan(["toy", "-n", "6", "--shard-degree", "2", "--min-world", "2", "--micro-batch-size", "2",
                    "--global-batch-size", "24", "--deterministic"])  # fmt: skip
    with pytest.raises(PlanRefused) as at_launch:
        _launcher_plan(["toy", "-n", "6", "--shard-degree", "2", "--min-world", "2", *cut])
    assert str(at_launch.value) == (
        "--shard-degree 2 and --min-world on 6 ranks, 6 micro-batches of 2 in a step: live mode redoes a step "
        "lost with a replica group over the groups left, and every rank computes as many micro-batches as the "
        "others: a step's micro-batches must divide evenly over every world the groups can shrink to (whole "
        "groups, down to --min-world); make them a multiple of 12, e.g. --global-batch-size 24 "
        "--micro-batch-size 2"
    )
    config = FitConfig(shard_degree=2, deterministic=True, global_batch_size=12, micro_batch_size=2)
    with pytest.raises(PlanRefused) as in_fit:
        fit_plan_of(config, 6, live=True)
    assert at_launch.value.rule is in_fit.value.rule
    assert str(in_fit.value).endswith(
        "make them a multiple of 12, e.g. global_batch_size=24, micro_batch_size=2"
    )
    fit_plan_of(dataclasses.replace(config, global_batch_size=24), 6, live=True)
    fit_plan_of(dataclasses.replace(config, global_batch_size=8), 4, live=True)  # 4 micro-batches on 4 ranks
    fit_plan_of(config, 6, live=False)  # without live mode 6 micro-batches on 6 ranks run
    # --min-world bounds the worlds: 16 ranks as 8 groups of 2 down to 14 ranks, or down to one group
    assert survivable_multiple(16, 2, 14) == 112 and survivable_multiple(16, 2) == 1680
    with pytest.raises(PlanRefused, match="live recovery of a sharded periodic sync is not built"):
        fit_plan_of(
            FitConfig(shard_degree=2, sync="diloco", global_batch_size=16, micro_batch_size=4), 4, live=True
        )


def test_sharded_groups_meeting_every_h_steps_in_deterministic_mode_are_refused_at_each_door() -> None:
    """On 4 ranks (two groups of 2: the one-group check passes), deterministic mode is what is refused."""
    flags = ["--sync", "diloco", "--deterministic", "--global-batch-size", "16", "--micro-batch-size", "4"]
    with pytest.raises(PlanRefused) as launcher:
        _launcher_plan(["toy", "-n", "4", "--shard-degree", "2", *flags])
    assert str(launcher.value).startswith(
        "--shard-degree 2 with --sync diloco and --deterministic: deterministic mode's exact sums are not built"
    ), str(launcher.value)
    config = FitConfig(
        shard_degree=2, sync="diloco", deterministic=True, global_batch_size=16, micro_batch_size=4
    )
    with pytest.raises(PlanRefused) as fit:
        fit_plan_of(config, 4, live=False)
    assert str(fit.value).startswith("shard_degree=2 with sync='diloco' and deterministic=True: "), str(
        fit.value
    )
    assert launcher.value.rule is fit.value.rule
    fit_plan_of(dataclasses.replace(config, deterministic=False), 4, live=False)  # what it suggests runs


def test_one_group_suggests_a_shard_degree_that_makes_two() -> None:
    with pytest.raises(PlanRefused) as refused:
        _launcher_plan(["toy", "-n", "9", "--shard-degree", "9", "--sync", "diloco"])
    assert "e.g. --shard-degree 3," in str(refused.value), str(refused.value)
    _launcher_plan(["toy", "-n", "9", "--shard-degree", "3", "--sync", "diloco"])


def test_what_falls_back_with_shard_degree_says_so_once_at_each_door() -> None:
    overlap = (
        "--overlap-optimizer true with --shard-degree 2: FSDP2 steps the sharded optimizer after backward, each "
        "rank its own shards: there is no bucket's step to overlap with backward"
    )
    buckets = (
        "--bucket-cap-mb {} does not apply with --shard-degree 2: FSDP2's units are the buckets: each wrapped "
        "block's gradients are one reduce-scatter"
    )
    plan = _launcher_plan(["toy", "-n", "2", "--shard-degree", "2", "--overlap-optimizer", "true"])
    assert plan.notes() == [overlap]
    fit = fit_plan_of(FitConfig(shard_degree=2, overlap_optimizer=True), 2, live=False)
    assert fit.fallbacks == plan.fallbacks and fit.fallback("overlap_optimizer") is plan.fallbacks[0]
    for cap in ("10", "auto"):
        plan = _launcher_plan(["toy", "-n", "2", "--shard-degree", "2", "--bucket-cap-mb", cap])
        value = "auto" if cap == "auto" else 10.0
        assert plan.notes() == [buckets.format(value)]
        fit = fit_plan_of(FitConfig(shard_degree=2, bucket_cap_mb=value), 2, live=False)
        assert fit.fallbacks == plan.fallbacks


def test_what_runs_with_shard_degree_runs_at_each_door() -> None:
    runs = [
        ["--precision", "bf16"],
        ["--clip-grad-norm", "1.0"],
        ["--grad-accum-steps", "2"],
        ["--deterministic", "--global-batch-size", "64", "--micro-batch-size", "8"],
        ["--sync", "allreduce"],
        ["--checkpoint-every", "5", "--checkpoint-async", "true", "--keep-checkpoints", "2"],
        ["--reshard-after-forward", "false"],
        ["--max-restarts", "2"],
    ]
    for flags in runs:
        assert _launcher_plan(["toy", "-n", "4", "--shard-degree", "2", *flags]).notes() == [], flags
    config = FitConfig(shard_degree=4, precision="bf16", clip_grad_norm=1.0, grad_accum_steps=2)
    assert fit_plan_of(config, 4, live=False).fallbacks == ()
    # the engine's door: the reduce-scatter's dtype (FSDP2's MixedPrecisionPolicy.reduce_dtype) runs
    engine = RunSettings(shard_degree=2, world_size=2, reduce_dtype=torch.bfloat16, deterministic=False)
    assert Plan.of(engine).fallbacks == ()


def test_shard_degree_and_reshard_after_forward_are_flags_of_lockstep_train() -> None:
    config = resolve_config("toy", None, [], None)
    assert config.shard_degree == 1 and config.reshard_after_forward is True
    config = resolve_config("toy", None, ["--shard-degree", "4", "--reshard-after-forward", "false"], None)
    assert config.shard_degree == 4 and config.reshard_after_forward is False
    assert (
        resolve_config("digits", None, ["--shard_degree=2", "--reshard-after-forward"], None).shard_degree
        == 2
    )
    with pytest.raises(
        ConfigError, match=r"^shard_degree='0' from --shard-degree: expected an int >= 1, got 0"
    ):
        resolve_config("toy", None, ["--shard-degree", "0"], None)
    with pytest.raises(ConfigError, match=r"^reshard_after_forward='maybe' from --reshard-after-forward: "):
        resolve_config("toy", None, ["--reshard-after-forward", "maybe"], None)
    with pytest.raises(ConfigError, match=r"^shard_degree=0 from FitConfig\(\.\.\.\): expected an int >= 1"):
        FitConfig(shard_degree=0)
    assert RunSettings.of(FitConfig(shard_degree=2), world_size=2).keys() == [
        "shard_degree",
        "sync=allreduce",
    ]
    assert RunSettings.of(FitConfig(), world_size=2).keys() == ["sync=allreduce"]  # 1: no key of the table


def test_the_launcher_refuses_a_shard_degree_that_does_not_divide_the_world_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "lockstep", "train", "toy", "--shard-degree", "3", "-n", "4"]
    start = time.monotonic()
    done = subprocess.run(
        [*command, "--run-dir", str(run_dir)], capture_output=True, text=True, env=env, timeout=60
    )
    took = time.monotonic() - start
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr == (
        "lockstep train: error: --shard-degree 3 does not divide the world size 4 (-n 4): the world must be a "
        "whole number of shard groups; use a divisor of 4 (1, 2, 4)\n"
    )
    assert not run_dir.exists()  # refused before the config is saved or a worker starts
    assert took < 2.0, f"the refusal took {took:.2f} s"
