"""The run's plan (lockstep/plan.py): one table decides which pairs of run settings run, fall back or are
refused; the refusal is one line naming both settings and what to do instead; docs/modes.md shows the table
as the code writes it."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.errors import ConfigError
from lockstep.plan import (
    RULES,
    SETTINGS,
    Plan,
    PlanRefused,
    Reduction,
    RunSettings,
    Verdict,
    markdown_table,
    rule_for,
)
from lockstep.trainer.settings.config import FitConfig

ROOT = Path(__file__).resolve().parents[2]


def test_docs_show_the_table_the_code_holds() -> None:
    page = (ROOT / "docs" / "modes.md").read_text()
    begin, end = "<!-- plan-table:begin -->\n", "<!-- plan-table:end -->"
    shown = page[page.index(begin) + len(begin) : page.index(end)]
    assert shown == markdown_table(), (
        "docs/modes.md's table differs from lockstep.plan.markdown_table(): regenerate it"
    )


def test_every_rule_names_two_known_settings_once() -> None:
    keys = [s.key for s in SETTINGS]
    pairs = [frozenset((r.first, r.second)) for r in RULES]
    assert len(pairs) == len(set(pairs)), "a pair of settings has two rules"
    for rule in RULES:
        assert rule.first in keys and rule.second in keys and rule.first != rule.second
        assert rule.verdict is not Verdict.RUNS and rule.reason
        assert rule.instead or rule.verdict is Verdict.FALLS_BACK, f"{rule} is refused without an alternative"


def test_a_pair_not_in_the_table_runs_and_order_does_not_matter() -> None:
    assert rule_for("live", "max_restarts").verdict is Verdict.RUNS
    assert rule_for("sync=diloco", "shard_optimizer") is rule_for("shard_optimizer", "sync=diloco")
    with pytest.raises(ConfigError, match="no run setting 'sync=ring'"):
        rule_for("sync=ring", "live")


def test_settings_map_to_the_table_keys() -> None:
    assert RunSettings().keys() == []  # every default is no key: all-reduce, fp32, torch's bucket size
    settings = RunSettings.of(
        FitConfig(sync="diloco", bucket_cap_mb=4, precision="bf16", grad_accum_steps=2, clip_grad_norm=1.0),
        world_size=2,
        live=True,
        max_restarts=1,
    )
    assert settings.keys() == [
        "live",
        "sync=diloco",
        "bucket_cap_mb",
        "grad_accum_steps",
        "clip_grad_norm",
        "precision=bf16",
        "max_restarts",
    ]
    assert RunSettings(bucket_cap_mb="auto", precision="fp16").keys() == [
        "bucket_cap_mb=auto",
        "precision=fp16",
    ]


def _settings_for(keys: tuple[str, ...]) -> RunSettings:
    values: dict[str, object] = {}
    for key in keys:
        name, _, value = key.partition("=")
        if name == "bucket_cap_mb":
            values[name] = value or 4.0
        elif name in ("sync", "precision", "sync_dtype"):
            values[name] = value
        elif name == "grad_accum_steps":
            values[name] = 2
        elif name == "clip_grad_norm":
            values[name] = 1.0
        elif name in ("max_restarts", "sync_warmup"):
            values[name] = 1
        elif name in ("fragments", "fragment_delay"):
            values[name] = 2
        elif name == "shard_degree":  # on a world it divides into two groups (VALUE_CHECKS)
            values.update(shard_degree=2, world_size=4)
        else:
            values[name] = True
    return RunSettings(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("flags", [True, False])
def test_every_pair_runs_falls_back_or_is_refused_in_one_line(flags: bool) -> None:
    keys = [s.key for s in SETTINGS]
    for pair in itertools.combinations(keys, 2):
        if {k.partition("=")[0] for k in pair} in (
            {"sync"},
            {"precision"},
            {"bucket_cap_mb"},
            {"sync_dtype"},
        ):
            continue  # one setting, two values
        settings = _settings_for(pair)
        assert settings.keys() == list(pair)
        rule = rule_for(*pair)
        if rule.verdict is Verdict.REFUSED:
            with pytest.raises(PlanRefused) as refused:
                Plan.of(settings, flags=flags)
            line = str(refused.value)
            assert "\n" not in line and refused.value.rule is rule
            assert line.endswith(rule.instead)
            if flags:
                for key in pair:
                    flag = next(s.flag for s in SETTINGS if s.key == key).partition(" ")[0].partition("=")[0]
                    assert flag in line, f"{line!r} does not name {flag}"
        else:
            plan = Plan.of(settings, flags=flags)
            assert plan.fallbacks == ((rule,) if rule.verdict is Verdict.FALLS_BACK else ())


def test_refusals_spell_the_settings_as_python_for_fit() -> None:
    with pytest.raises(
        PlanRefused, match=r"^shard_optimizer=True with sync='diloco': .*; choose one of the two"
    ):
        Plan.of(RunSettings(shard_optimizer=True, sync="diloco"))
    with pytest.raises(PlanRefused, match=r"^bucket_cap_mb=4\.0 does not apply with deterministic=True: "):
        Plan.of(RunSettings(bucket_cap_mb=4.0, deterministic=True))
    with pytest.raises(PlanRefused, match=r"^--bucket-cap-mb 4\.0 does not apply with --deterministic: "):
        Plan.of(RunSettings(bucket_cap_mb=4.0, deterministic=True), flags=True)


def test_fallbacks_are_asked_by_the_setting_that_does_not_apply() -> None:
    plan = Plan.of(RunSettings(overlap_optimizer=True, sync="local_sgd", clip_grad_norm=1.0))
    first = plan.fallback("overlap_optimizer")
    assert first is not None and first.second == "sync=local_sgd"
    assert plan.fallback("sync=local_sgd") is None
    assert len(plan.notes()) == 2 and all(
        n.startswith("--overlap-optimizer true with ") for n in plan.notes()
    )


def test_quantized_outer_gradients_need_diloco_s_outer_gradients() -> None:
    settings = RunSettings.of(FitConfig(sync="diloco", sync_dtype="int8"), world_size=2)
    assert settings.keys() == ["sync=diloco", "sync_dtype=int8"]
    assert RunSettings(sync_dtype="bf16").keys() == []  # the casts are no keys of the table
    assert Plan.of(settings).notes() == []
    for dtype in ("int8", "int4", "fp4_e3m0"):
        with pytest.raises(
            PlanRefused,
            match=rf"^--sync-dtype {dtype} does not apply with --sync local_sgd: local SGD averages the "
            "parameters themselves.*; use --sync diloco",
        ):
            Plan.of(RunSettings(sync="local_sgd", sync_dtype=dtype), flags=True)
        # with the every-step all-reduce the gradients go on in fp32: the table's fallback, said once
        settings = RunSettings(sync="allreduce", sync_dtype=dtype)
        assert settings.keys() == ["sync=allreduce", f"sync_dtype={dtype}"]
        assert Plan.of(settings).notes() == [
            f"--sync-dtype {dtype} does not apply with --sync allreduce: a quantized dtype applies to a periodic "
            "sync's outer gradients only (diloco, streaming_diloco): the every-step all-reduce averages the "
            "gradients in fp32"
        ]


def test_deterministic_mode_needs_a_global_batch_that_the_world_size_does_not_make() -> None:
    # A default made from this launch's ranks would change at a resume on another number of ranks.
    with pytest.raises(
        PlanRefused, match=r"^--deterministic without --global-batch-size: .*; pass one, e\.g\. "
    ):
        Plan.of(RunSettings(deterministic=True, batch_size=16, grad_accum_steps=2, world_size=3), flags=True)
    with pytest.raises(
        PlanRefused, match=r"^deterministic=True without global_batch_size: .*; set one, e\.g\. "
    ):
        Plan.of(RunSettings.of(FitConfig(deterministic=True), world_size=3))
    given = Plan.of(RunSettings(deterministic=True, batch_size=16, global_batch_size=64, world_size=3))
    assert given.notes() == []
    assert Plan.of(RunSettings(deterministic=True)).notes() == []  # SyncPolicy's door cuts no batch


def test_float_live_mode_needs_a_micro_batch_per_launched_rank() -> None:
    few = RunSettings(live=True, batch_size=32, global_batch_size=24, micro_batch_size=12, world_size=4)
    assert few.live_cut() == (24, 12, 2)
    with pytest.raises(
        PlanRefused,
        match=r"^--min-world without --deterministic on 4 ranks, 2 micro-batches of 12 in a step of 24 samples: "
        r".*; lower --micro-batch-size, raise --global-batch-size, or add --deterministic$",
    ):
        Plan.of(few, flags=True)
    Plan.of(dataclasses.replace(few, micro_batch_size=4))  # 6 micro-batches: every rank has one
    Plan.of(dataclasses.replace(few, live=False))  # outside live mode the step is cut by rank
    # deterministic mode's micro-batches need not match the ranks
    Plan.of(dataclasses.replace(few, deterministic=True))
    # the default global batch: the per-rank batch on every launched rank
    assert RunSettings(live=True, batch_size=8, grad_accum_steps=2, world_size=4).live_cut() == (64, 8, 8)


def test_the_plan_and_the_configs_import_without_torch() -> None:
    code = (
        "import sys, lockstep.plan, lockstep.jobs.configs, lockstep.jobs.cli; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_the_plan_decides_the_engine_s_mode() -> None:
    assert Plan.of(RunSettings()).reduction is Reduction.BUCKETED
    assert Plan.of(RunSettings(deterministic=True)).reduction is Reduction.EXACT
    for sync in ("local_sgd", "diloco", "streaming_diloco"):  # deterministic or not: the periodic mode
        assert Plan.of(RunSettings(sync=sync)).reduction is Reduction.PERIODIC
        assert Plan.of(RunSettings(sync=sync, deterministic=True)).reduction is Reduction.PERIODIC
    import lockstep  # the engine's policy holds its plan

    assert lockstep.SyncPolicy(sync="diloco").plan.reduction is Reduction.PERIODIC
    with pytest.raises(PlanRefused, match=r"^static_graph=True does not apply with deterministic=True: "):
        lockstep.SyncPolicy(deterministic=True, static_graph=True)
