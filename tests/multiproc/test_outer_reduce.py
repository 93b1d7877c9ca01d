"""Quantized outer gradients over 3 and 4 ranks (engine/outer_reduce.py): a quantized reduce-scatter of
128-value-block chunks, then an all-gather of the re-quantized mean chunks, against test_outer_sync's
reference (its `_scattered_mean`): the ranks end with the reference's bits, runs repeat bitwise, a
resume mid-round (waited for, or live mode's contributions sent again) continues bit for bit, streaming
DiLoCo's means in flight are their second phase (the first is waited for at the launch: rank 0 may wait
for a mean alone, engine/outer_reduce.py), comm_bytes is what each rank sends the others in both. Deterministic mode where a test compares with the reference: the float32
buffers are then gathered and summed in rank order too (else gloo's all-reduce sums them in its order).
The models: test_outer_sync's (72 values, fewer blocks than ranks: some
chunks empty) and a wider one (1,809 values: 15 blocks, no multiple of W * 128)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep.engine.outer_codec import NonFiniteOuterGradient, codec_for
from lockstep.testing import run_distributed
from tests.multiproc.test_outer_sync import (
    EVERY,
    STEPS,
    _assert_same,
    _inner,
    _model,
    _policy,
    _rank_run,
    _reference,
)

WIDE = 200  # _model(WIDE): 1,809 values
SCATTER, GATHER = "outer sync (all_to_all)", "outer sync (all_gather)"


def _run(world: int, sync: str, extra: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
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
    outs = _run(world, "diloco", {"delta_dtype": wire, "deterministic": True}, width=width)
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
    runs = [_run(4, "diloco", extra, width=WIDE) for _ in range(2)]
    for rank in range(4):
        _assert_same(runs[0][rank]["state"], runs[1][rank]["state"], f"int4 W=4 rank {rank}, two runs")
        assert runs[0][rank]["stats"] == runs[1][rank]["stats"]


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_streaming_with_fragment_delay_2_over_3_ranks_gives_the_reference_bits(wire: str) -> None:
    """fragment_delay=2: fragment 1 (launched at step 3) and 0 (at 4) in flight at once (each mean's
    second phase: its first one is waited for at the launch), each applied two steps after its launch."""
    extra = {"delta_dtype": wire, "fragment_delay": 2, "fragment_layout": "strided", "deterministic": True}
    outs = _run(3, "streaming_diloco", extra, width=WIDE)
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
    straight = _run(3, sync, extra, width=WIDE)
    resumed = _run(3, sync, extra, width=WIDE, resume_at=4)
    for rank in range(3):
        _assert_same(resumed[rank]["state"], straight[rank]["state"], f"{sync} rank {rank} resumed")
        assert resumed[rank]["stats"] == straight[rank]["stats"]


def test_contributions_sent_again_over_4_ranks_give_the_same_bits() -> None:
    """Live mode's mark (sync_state_dict(wait=False)) with two means in flight: each rank's float32
    contribution is saved, and the replica it is loaded into sends it again through both phases."""
    extra = {"delta_dtype": "int4", "fragment_delay": 2, "deterministic": True}
    straight = _run(4, "streaming_diloco", extra, width=WIDE)
    resent = _run(4, "streaming_diloco", extra, width=WIDE, resume_at=4, wait=False)
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
    straight = _run(3, "streaming_diloco", extra, width=WIDE)
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
