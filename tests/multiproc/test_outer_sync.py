"""Low-communication training in replicate: local SGD, DiLoCo and streaming DiLoCo against a reference.

The reference (tests.helpers.outer_reference, shared with the GPU tier) runs every worker in one process, one
after the other, with the same inner math (each its own model copy, AdamW and data) and the outer math written
out plainly: the mean of the parameters (local SGD), or the mean of the outer gradients anchor - local fed to
torch's SGD with Nesterov momentum (rising from 0 to 0.9 over the first outer steps, the default) on the
anchor (DiLoCo), fragment by fragment on their staggered steps, each applied fragment_delay inner steps after
its launch (one by default; several may be in flight at once) and merged with the local values (streaming).
The ranks end with the reference's parameters bit for bit; the bytes they report must be what the mode sends;
a resume from sync_state_dict() mid-round must continue exactly. Quantized outer gradients over 3 ranks or
more take the engine's reduce-scatter (engine/periodic/outer_reduce.py): tests.helpers.scattered_mean writes it out.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.engine.core.outer_codec import NonFiniteOuterGradient, codec_for
from lockstep.engine.periodic.outer_sync import fragment_bounds
from lockstep.errors import ConfigError, NotSupportedError
from lockstep.runtime.progress import PROGRESS
from lockstep.testing import run_distributed
from tests.helpers import OUTER_EVERY as EVERY
from tests.helpers import OUTER_STEPS as STEPS
from tests.helpers import outer_inner as _inner
from tests.helpers import outer_model as _model
from tests.helpers import outer_reference as _reference


def _policy(sync: str, **extra: Any) -> lockstep.SyncPolicy:
    fragments = 2 if sync == "streaming_diloco" else 1
    return lockstep.SyncPolicy(sync=sync, sync_every=EVERY, fragments=fragments, **extra)


def _rank_run(
    sync: str, extra: dict[str, Any], resume_at: int | None, width: int = 7, wait: bool = True
) -> dict[str, Any]:
    """`wait=False`: the resume's state taken without waiting for the means in flight (live mode's mark):
    this rank's contributions, sent again by the replica it is loaded into."""
    rank = dist.get_rank()
    model = _model(width)
    handle = lockstep.replicate(model, policy=_policy(sync, **extra))
    # A pooled rank process ran other tests before; their records are kept referenced here, so that no
    # record made later can reuse one's id() once the bounded history drops it.
    before = list(PROGRESS.recent)
    earlier = {id(r) for r in before}
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    synced = []
    for step in range(STEPS):
        if step == resume_at:  # a fresh replica, optimizer and outer state from what was saved
            saved = (model.state_dict(), opt.state_dict(), handle.sync_state_dict(wait=wait))
            handle.remove()
            model = _model(width)
            handle = lockstep.replicate(model, policy=_policy(sync, **extra))
            model.load_state_dict(saved[0])
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            opt.load_state_dict(saved[1])
            handle.load_sync_state_dict(saved[2])
        _inner(model, opt, rank, step)
        synced.append(handle.after_optimizer_step())
    numbered = [
        (r.seq, r.op) for r in PROGRESS.recent if r.op.startswith("outer sync") and id(r) not in earlier
    ]
    return {
        "state": model.state_dict(),
        "synced": synced,
        "stats": handle.stats().extras,
        "numbered": numbered,
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{where}: {name} differs by {(got[name] - value).abs().max()}"


@pytest.mark.parametrize(
    ("sync", "layout"),
    [
        ("local_sgd", "strided"),
        ("diloco", "strided"),
        ("streaming_diloco", "strided"),
        ("streaming_diloco", "contiguous"),
    ],
)
def test_each_mode_gives_the_reference_bits_and_reports_its_bytes(sync: str, layout: str) -> None:
    world = 2
    outs = run_distributed(_rank_run, world, args=(sync, {"fragment_layout": layout}, None), timeout=120)
    want = _reference(sync, world, None, layout)
    numel = sum(p.numel() for p in _model().parameters())
    buffers = sum(b.numel() for b in _model().buffers() if b.is_floating_point())
    rounds = STEPS // EVERY
    for rank, out in enumerate(outs):
        _assert_same(out["state"], want[rank], f"{sync} rank {rank}")
        if sync != "streaming_diloco":  # the last step closes a round: every worker on the same parameters
            _assert_same(out["state"], want[0], f"{sync} rank {rank} vs worker 0")
        stats = out["stats"]
        assert stats["inner_steps"] == STEPS
        # streaming: the last fragment, launched at the last step, is still in flight (its buffers with it)
        buffer_syncs = rounds - 1 if sync == "streaming_diloco" else rounds
        assert stats["bytes_communicated_total"] == 4 * (numel * rounds + buffers * buffer_syncs), stats
    # the hang watchdog numbers each outer collective like any other (parameters, then buffers at a round's end)
    numbered = outs[0]["numbered"]
    assert len(numbered) == (2 if sync == "streaming_diloco" else 1) * rounds + buffer_syncs, numbered
    assert [seq for seq, _ in numbered] == sorted({seq for seq, _ in numbered}), numbered
    assert numbered == outs[1]["numbered"]
    synced = outs[0]["synced"]
    if sync == "streaming_diloco":
        assert synced == [True, False, True] * rounds, (
            synced
        )  # fragment 0 at steps 1, 4, 7; fragment 1 at 3, 6, 9
        assert outs[0]["stats"]["outer_syncs"] == 2 * rounds - 1  # applied; the last one is in flight
    else:
        assert synced == [False, False, True] * rounds, synced


@pytest.mark.parametrize("sync", ["local_sgd", "diloco", "streaming_diloco"])
def test_a_resume_mid_round_continues_bit_for_bit(sync: str) -> None:
    straight = run_distributed(_rank_run, 2, args=(sync, {}, None), timeout=120)
    resumed = run_distributed(_rank_run, 2, args=(sync, {}, 4), timeout=120)
    for rank in range(2):
        _assert_same(resumed[rank]["state"], straight[rank]["state"], f"{sync} rank {rank} resumed at step 4")
        assert resumed[rank]["stats"] == straight[rank]["stats"]


@pytest.mark.parametrize("delay", [0, 2, EVERY])
def test_streaming_with_a_longer_or_no_overlap_gives_the_reference_bits(delay: int) -> None:
    """fragment_delay (tau): each fragment's mean applied `delay` inner steps after its launch; with 2 or 3
    (= sync_every) two fragments are in flight at once (fragment 1 launched at step 3, fragment 0 at 4)."""
    extra = {"fragment_layout": "strided", "fragment_delay": delay}
    outs = run_distributed(_rank_run, 2, args=("streaming_diloco", extra, None), timeout=120)
    want = _reference("streaming_diloco", 2, None, "strided", delay)
    other = _reference("streaming_diloco", 2, None, "strided", 1)
    for rank, out in enumerate(outs):
        _assert_same(out["state"], want[rank], f"fragment_delay={delay} rank {rank}")
        launches = [1, 3, 4, 6, 7, 9]  # fragment 0 at 1, 4, 7; fragment 1 at 3, 6, 9
        applied = [t for t in launches if t + delay <= STEPS]  # the others are still in flight at the end
        assert out["stats"]["outer_syncs"] == len(applied), (delay, out["stats"])
    assert not torch.equal(want[0]["0.weight"], other[0]["0.weight"])  # the delay changed something


def test_a_resume_with_two_fragments_in_flight_continues_bit_for_bit() -> None:
    """Resumed after step 4 with fragment_delay 2: fragment 1 (launched at step 3) and fragment 0 (at 4)
    are both in flight in the saved state; they are applied at steps 5 and 6 as in the straight run."""
    extra = {"fragment_delay": 2}
    straight = run_distributed(_rank_run, 2, args=("streaming_diloco", extra, None), timeout=120)
    resumed = run_distributed(_rank_run, 2, args=("streaming_diloco", extra, 4), timeout=120)
    for rank in range(2):
        _assert_same(resumed[rank]["state"], straight[rank]["state"], f"rank {rank} resumed at step 4")
        assert resumed[rank]["stats"] == straight[rank]["stats"]


def _flushed() -> dict[str, Any]:
    model = _model()
    handle = lockstep.replicate(model, policy=_policy("streaming_diloco"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        _inner(model, opt, dist.get_rank(), step)
        handle.after_optimizer_step()
    flushed = [handle.flush_sync(), handle.flush_sync()]
    return {"flushed": flushed, "stats": handle.stats().extras, "state": model.state_dict()}


def test_flush_sync_applies_the_fragment_in_flight_once() -> None:
    outs = run_distributed(_flushed, 2, timeout=120)
    for out in outs:
        assert out["flushed"] == [True, False]
        assert out["stats"]["outer_syncs"] == 2 * (STEPS // EVERY)  # every fragment of every round applied
    for name, value in outs[0]["state"].items():
        if "running" in name or "num_batches" in name:
            assert torch.equal(value, outs[1]["state"][name]), name  # buffers averaged with the last fragment


def test_deltas_in_bfloat16_are_summed_in_float32_in_rank_order_at_world_3() -> None:
    outs = run_distributed(_rank_run, 3, args=("diloco", {"delta_dtype": torch.bfloat16}, None), timeout=120)
    want = _reference("diloco", 3, torch.bfloat16)
    numel = sum(p.numel() for p in _model().parameters())
    buffers = sum(b.numel() for b in _model().buffers() if b.is_floating_point())
    for rank, out in enumerate(outs):
        _assert_same(out["state"], want[rank], f"bf16 deltas rank {rank}")
        assert out["stats"]["bytes_communicated_total"] == 2 * (numel + buffers) * (STEPS // EVERY)


@pytest.mark.parametrize("wire", ["int8", "int4", "fp4_e3m0"])
def test_quantized_outer_gradients_give_the_reference_bits_and_send_their_payload(wire: str) -> None:
    """Each rank's outer gradient quantized, gathered, decoded and summed in float32 in rank order (the
    reference: the same round trip per worker); the buffers in float32; comm_bytes the payloads' size."""
    outs = run_distributed(_rank_run, 2, args=("diloco", {"delta_dtype": wire}, None), timeout=120)
    want = _reference("diloco", 2, wire)
    fp32 = _reference("diloco", 2, None)
    numel = sum(p.numel() for p in _model().parameters())
    buffers = sum(b.numel() for b in _model().buffers() if b.is_floating_point())
    for rank, out in enumerate(outs):
        _assert_same(out["state"], want[rank], f"{wire} deltas rank {rank}")
        per_round = codec_for(wire).payload_bytes(numel) + 4 * buffers
        assert out["stats"]["bytes_communicated_total"] == per_round * (STEPS // EVERY)
    assert not torch.equal(want[0]["0.weight"], fp32[0]["0.weight"])  # the wire changed something


@pytest.mark.parametrize("sync", ["diloco", "streaming_diloco"])
def test_quantized_outer_gradients_resume_mid_round_bit_for_bit(sync: str) -> None:
    extra = {"delta_dtype": "int4"}
    straight = run_distributed(_rank_run, 2, args=(sync, extra, None), timeout=120)
    resumed = run_distributed(_rank_run, 2, args=(sync, extra, 4), timeout=120)
    for rank in range(2):
        _assert_same(resumed[rank]["state"], straight[rank]["state"], f"int4 {sync} rank {rank} resumed")
        assert resumed[rank]["stats"] == straight[rank]["stats"]


def test_quantized_deterministic_runs_give_the_same_bits_at_world_3() -> None:
    extra = {"deterministic": True, "delta_dtype": "fp4_e3m0"}
    runs = [run_distributed(_rank_run, 3, args=("diloco", extra, None), timeout=120) for _ in range(2)]
    want = _reference("diloco", 3, "fp4_e3m0")
    for rank in range(3):
        _assert_same(runs[0][rank]["state"], runs[1][rank]["state"], f"fp4 rank {rank}, two runs")
        _assert_same(runs[0][rank]["state"], want[rank], f"fp4 rank {rank} vs the rank-order reference")


def test_deterministic_mode_gives_the_same_bits_run_after_run_at_world_3() -> None:
    runs = [
        run_distributed(_rank_run, 3, args=("diloco", {"deterministic": True}, None), timeout=120)
        for _ in range(2)
    ]
    want = _reference("diloco", 3, None)
    for rank in range(3):
        _assert_same(runs[0][rank]["state"], runs[1][rank]["state"], f"rank {rank}, two runs")
        _assert_same(runs[0][rank]["state"], want[rank], f"rank {rank} vs the rank-order reference")


def _refusals() -> list[str]:
    model = _model()
    handle = lockstep.replicate(model, policy=_policy("diloco"))
    errors = []
    for call in (
        lambda: handle.accumulate(lambda b: None, {}, num_micro_batches=2, step=0),
        lambda: handle.register_comm_hook(None, lambda s, b: None),
    ):
        try:
            call()
        except NotSupportedError as exc:
            errors.append(str(exc))
    plain = lockstep.replicate(_model())
    try:
        plain.after_optimizer_step()
    except NotSupportedError as exc:
        errors.append(str(exc))
    return errors


def test_what_does_not_apply_raises_and_says_why() -> None:
    errors = run_distributed(_refusals, 2, timeout=90)[0]
    assert len(errors) == 3, errors
    assert all("sync='diloco'" in e and "after_optimizer_step" in e for e in errors[:2]), errors
    assert "sync='allreduce'" in errors[2], errors


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"sync": "gossip"}, "SyncPolicy.sync must be one of"),
        ({"sync": "diloco", "sync_every": 0}, "sync_every must be an int >= 1"),
        ({"sync": "diloco", "outer_momentum": 1.0}, "0 <= outer_momentum < 1"),
        ({"sync": "diloco", "fragments": 2}, "fragments=2 does not apply with sync='diloco': only streaming"),
        ({"sync": "diloco", "fragment_delay": 2}, "fragment_delay=2 does not apply with sync='diloco'"),
        ({"sync": "streaming_diloco", "fragment_delay": -1}, "fragment_delay must be an int >= 0"),
        ({"sync": "streaming_diloco", "sync_every": 4, "fragment_delay": 5}, "at most sync_every=4"),
        ({"sync": "local_sgd", "static_graph": True}, "averages no gradient in backward"),
        ({"sync": "diloco", "delta_dtype": torch.int8}, "delta_dtype must be"),
        ({"sync": "diloco", "delta_dtype": "int3"}, "delta_dtype must be"),
        ({"sync": "local_sgd", "delta_dtype": "int4"}, "local SGD averages the parameters themselves"),
    ],
)
def test_policy_settings_are_checked(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        lockstep.SyncPolicy(**fields)


def test_a_quantized_delta_dtype_without_a_periodic_sync_falls_back() -> None:
    # the plan's verdict (lockstep/plan.py), as `lockstep train --sync-dtype int8` gives it: the all-reduce
    # averages the gradients in fp32 every step
    (rule,) = lockstep.SyncPolicy(delta_dtype="int8").plan.fallbacks
    assert (rule.first, rule.second) == ("sync_dtype=int8", "sync=allreduce")


def test_fragments_are_contiguous_balanced_and_never_empty() -> None:
    assert fragment_bounds([10] * 10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert fragment_bounds([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert fragment_bounds([1, 1, 1, 100], 2) == [range(0, 3), range(3, 4)]
    with pytest.raises(ConfigError, match="1 to 2 fragments"):
        fragment_bounds([1, 1], 3)


# ---------------------------------------------------------------- over 3 and 4 ranks
#
# Quantized outer gradients over 3 and 4 ranks (engine/periodic/outer_reduce.py): a quantized reduce-scatter of
# 128-value-block chunks, then an all-gather of the re-quantized mean chunks, against this module's
# reference (tests.helpers.scattered_mean): the ranks end with the reference's bits, runs repeat bitwise, a
# resume mid-round (waited for, or live mode's contributions sent again) continues bit for bit, streaming
# DiLoCo's means in flight are their second phase (the first is waited for at the launch: rank 0 may wait
# for a mean alone, engine/periodic/outer_reduce.py), comm_bytes is what each rank sends the others in both.
# Deterministic mode where a test compares with the reference: the float32 buffers are then gathered and
# summed in rank order too (else gloo's all-reduce sums them in its order). The models: _model()'s (72
# values, fewer blocks than ranks: some chunks empty) and a wider one (1,809 values: 15 blocks, no
# multiple of W * 128).

WIDE = 200  # _model(WIDE): 1,809 values
SCATTER, GATHER = "outer sync (all_to_all)", "outer sync (all_gather)"


def _run_over(world: int, sync: str, extra: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    args = (sync, extra, kw.get("resume_at"), kw.get("width", 7), kw.get("wait", True))
    return run_distributed(_rank_run, world, args=args, timeout=180)


def _sizes(width: int) -> tuple[int, int]:
    model = _model(width)
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    return sum(p.numel() for p in model.parameters()), buffers


def _sent(wire: str, numel: int, world: int, rank: int) -> int:
    """The bytes a rank sends the others in one mean: the encoded chunks of the W - 1 others (whole 128-value
    blocks, B = qW + r: the first r chunks take q + 1 blocks, the others q), then its mean chunk padded to
    the largest chunk's payload."""
    codec, blocks = codec_for(wire), -(-numel // 128)
    q, r = divmod(blocks, world)
    edges = [min(numel, (j * q + min(j, r)) * 128) for j in range(world + 1)]
    payloads = [codec.payload_bytes(b - a) for a, b in zip(edges, edges[1:])]
    return sum(payloads) - payloads[rank] + max(payloads)


@pytest.mark.parametrize(
    ("wire", "world", "width"), [("int8", 3, WIDE), ("int4", 4, WIDE), ("int8", 4, 7), ("int4", 3, 7)]
)
def test_quantized_diloco_over_3_and_4_ranks_gives_the_reduce_scatter_bits(
    wire: str, world: int, width: int
) -> None:
    # deterministic: the float32 buffers gathered and summed in rank order too, as the reference does
    outs = _run_over(world, "diloco", {"delta_dtype": wire, "deterministic": True}, width=width)
    want = _reference("diloco", world, wire, width=width)
    numel, buffers = _sizes(width)
    rounds = STEPS // EVERY
    for rank, out in enumerate(outs):
        _assert_same(out["state"], want[rank], f"{wire} W={world} width {width} rank {rank}")
        _assert_same(out["state"], want[0], f"{wire} W={world} rank {rank} vs worker 0")
        per_round = _sent(wire, numel, world, rank) + 4 * buffers
        assert out["stats"]["bytes_communicated_total"] == per_round * rounds, out["stats"]
        # each round: the reduce-scatter, the mean's all-gather, then the buffers' float32 all-gather
        assert [op for _, op in out["numbered"]] == [SCATTER, GATHER, GATHER] * rounds, out["numbered"]
        assert out["numbered"] == outs[0]["numbered"]
    # the second quantization of the mean: not what gathering every rank's values (quantized once) gives
    once = _reference("diloco", world, wire, width=width, gather=True)
    assert not torch.equal(want[0]["0.weight"], once[0]["0.weight"])


def test_quantized_runs_over_4_ranks_repeat_bitwise() -> None:
    extra = {"delta_dtype": "int4", "deterministic": True}
    runs = [_run_over(4, "diloco", extra, width=WIDE) for _ in range(2)]
    for rank in range(4):
        _assert_same(runs[0][rank]["state"], runs[1][rank]["state"], f"int4 W=4 rank {rank}, two runs")
        assert runs[0][rank]["stats"] == runs[1][rank]["stats"]


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_streaming_with_fragment_delay_2_over_3_ranks_gives_the_reference_bits(wire: str) -> None:
    """fragment_delay=2: fragment 1 (launched at step 3) and 0 (at 4) in flight at once (each mean's
    second phase: its first one is waited for at the launch), each applied two steps after its launch."""
    extra = {"delta_dtype": wire, "fragment_delay": 2, "fragment_layout": "strided", "deterministic": True}
    outs = _run_over(3, "streaming_diloco", extra, width=WIDE)
    want = _reference("streaming_diloco", 3, wire, "strided", 2, width=WIDE)
    launches = [1, 3, 4, 6, 7, 9]  # fragment 0 at 1, 4, 7; fragment 1 at 3, 6, 9
    for rank, out in enumerate(outs):
        _assert_same(out["state"], want[rank], f"streaming {wire} rank {rank}")
        assert out["stats"]["outer_syncs"] == len([t for t in launches if t + 2 <= STEPS])
        ops = [op for _, op in out["numbered"]]
        # both phases at each launch (steps 1, 3, 4, 6, 7, 9); the buffers' all-gathers with fragment 1
        # applied at steps 5 and 8, before step 6's and 9's launches
        both = [SCATTER, GATHER]
        assert ops == both * 3 + [GATHER] + both * 2 + [GATHER] + both, ops
        assert out["numbered"] == outs[0]["numbered"]


@pytest.mark.parametrize(
    ("sync", "extra"),
    [
        ("diloco", {"delta_dtype": "int4"}),
        ("streaming_diloco", {"delta_dtype": "int8", "fragment_delay": 2}),
    ],
)
def test_a_resume_mid_round_over_3_ranks_continues_bit_for_bit(sync: str, extra: dict[str, Any]) -> None:
    """Resumed after step 4; streaming with fragment_delay 2 has two means in flight there (fragment 1's
    of step 3 and fragment 0's of step 4): waited for in the saved state."""
    straight = _run_over(3, sync, extra, width=WIDE)
    resumed = _run_over(3, sync, extra, width=WIDE, resume_at=4)
    for rank in range(3):
        _assert_same(resumed[rank]["state"], straight[rank]["state"], f"{sync} rank {rank} resumed")
        assert resumed[rank]["stats"] == straight[rank]["stats"]


def test_contributions_sent_again_over_4_ranks_give_the_same_bits() -> None:
    """Live mode's mark (sync_state_dict(wait=False)) with two means in flight: each rank's float32
    contribution is saved, and the replica it is loaded into sends it again through both phases."""
    extra = {"delta_dtype": "int4", "fragment_delay": 2, "deterministic": True}
    straight = _run_over(4, "streaming_diloco", extra, width=WIDE)
    resent = _run_over(4, "streaming_diloco", extra, width=WIDE, resume_at=4, wait=False)
    for rank in range(4):
        _assert_same(resent[rank]["state"], straight[rank]["state"], f"rank {rank}, contributions sent again")


def _rank_0_saves_alone(extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Streaming, as _rank_run, but after step 4 rank 0 alone takes the outer state (waiting for the means
    in flight, as its checkpoint does), then every rank meets in another collective."""
    model = _model(WIDE)
    handle = lockstep.replicate(model, policy=_policy("streaming_diloco", **extra))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        if step == 4:
            if dist.get_rank() == 0:
                handle.sync_state_dict()
            dist.all_reduce(torch.ones(3))  # a collective of every rank's, right after
        _inner(model, opt, dist.get_rank(), step)
        handle.after_optimizer_step()
    return model.state_dict()


def test_rank_0_waiting_alone_for_the_means_in_flight_launches_nothing_of_its_own() -> None:
    """A mean in flight is one collective waited for: rank 0 may wait for it alone (its checkpoint) without
    its collectives parting from its peers'."""
    extra = {"delta_dtype": "int8", "fragment_delay": 2, "deterministic": True}
    straight = _run_over(3, "streaming_diloco", extra, width=WIDE)
    alone = run_distributed(_rank_0_saves_alone, 3, args=(extra,), timeout=120)
    for rank in range(3):
        _assert_same(alone[rank], straight[rank]["state"], f"rank {rank}, rank 0 waited alone")


def _non_finite() -> str:
    model = _model(WIDE)
    policy = lockstep.SyncPolicy(sync="diloco", sync_every=1, delta_dtype="int8")
    handle = lockstep.replicate(model, policy=policy)
    with torch.no_grad():
        model[2].weight[1, 150] = float("nan")  # value 350 of '2.weight', 1,550 of all: the last chunk
    try:
        handle.after_optimizer_step()
    except NonFiniteOuterGradient as exc:
        return str(exc)
    return "no error"


def test_a_non_finite_outer_gradient_over_3_ranks_is_refused_naming_its_parameter() -> None:
    for rank, message in enumerate(run_distributed(_non_finite, 3, timeout=120)):
        assert f"[rank {rank}/3]" in message, message
        assert "parameter '2.weight' (value 350 of its 600)" in message, message
