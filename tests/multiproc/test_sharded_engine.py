"""lockstep.engine.sharded: torch's FSDP2 with lockstep's exact sums, checked against the replicated engine.

The oracle is the replicated engine in deterministic mode (itself the same bits at any world size): a
sharded run, FSDP or HSDP at any layout, ends with its parameters bit for bit, clipping included; the
rare paths of the exact sums (a parameter without a gradient in micro-batch 0, a micro-batch that
overflows the scale and makes the step redo) too. Outside deterministic mode FSDP2's own float sums are
compared with the replicated run up to rounding.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lockstep.data import MicroBatchSampler
from lockstep.engine import replicate
from lockstep.engine.core.policy import SyncPolicy
from lockstep.engine.deterministic.exact_norm import exact_clip_grad_norm_
from lockstep.engine.sharded import ShardPolicy, choose_units, full_tensors, shard
from lockstep.engine.sharded.units import check_shardable
from lockstep.errors import ConfigError, NotSupportedError
from lockstep.jobs.models import TinyGPT
from lockstep.testing import run_distributed
from lockstep.trainer import LiveLoop

TIMEOUT = 240
K = 4  # micro-batches per step: a multiple of every world size here
STEPS = 3
VOCAB = 29


class Gated(nn.Module):
    """A model whose `gate` gets no gradient in micro-batch 0 (its input is zero there) and whose
    micro-batch 3 has gradients 2**20 times micro-batch 0's (a redo at the agreed scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(24, 24) for _ in range(3)])
        self.gate = nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.blocks(x).tanh() * x[:, :1])


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, context=16, dim=32, depth=3, heads=4)


def _gpt_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 17), generator=g) for _ in range(K * STEPS)]


def _gated_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(3, 24, generator=g) for _ in range(K * STEPS)]
    for step in range(STEPS):
        batches[step * K][:, 0] = 0.0  # micro-batch 0: the gate's input is zero, so is its gradient
    batches[K + 3] *= 2.0**20  # step 1's micro-batch 3: far above micro-batch 0's scale
    return batches


def _loss(model: nn.Module, batch: torch.Tensor, gpt: bool) -> torch.Tensor:
    if gpt:
        out = model(batch[:, :-1])
        return nn.functional.cross_entropy(out.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    return model(batch).square().mean()


def _train(layout: str, model_name: str, clip: float | None) -> dict[str, Any]:
    """Three deterministic steps; the full parameters' hash and the last norm."""
    gpt = model_name == "gpt"
    torch.manual_seed(0)
    model = _gpt() if gpt else Gated()
    batches = _gpt_batches() if gpt else _gated_batches()
    handle: Any
    if layout == "replicated":
        handle = replicate(model, policy=SyncPolicy(deterministic=True))
    else:  # "N", or "N keep": reshard_after_forward=False (the gathered parameters kept until backward)
        degree, _, keep = layout.partition(" ")
        policy = ShardPolicy(shard_degree=int(degree), deterministic=True, reshard_after_forward=not keep)
        handle = shard(model, policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norm = None
    for step in range(STEPS):

        def micro(batch: torch.Tensor) -> float:
            loss = _loss(model, batch, gpt)
            loss.backward()
            return float(loss)

        owned = handle.owned_micro_batches(K)
        handle.accumulate(micro, {k: batches[step * K + k] for k in owned}, num_micro_batches=K, step=step)
        if clip is not None:
            if layout == "replicated":
                norm = float(exact_clip_grad_norm_(model.parameters(), clip))
            else:
                norm = float(handle.clip_grad_norm_(clip))
        optimizer.step()
        optimizer.zero_grad()
    state = full_tensors(model.state_dict())
    digest = hashlib.sha256()
    for name, value in state.items():
        digest.update(name.encode() + value.detach().contiguous().numpy().tobytes())
    redos = handle.stats().extras.get("steps_redone", 0) if layout != "replicated" else None
    return {"sha": digest.hexdigest(), "norm": norm, "redos": redos}


def _layouts(world: int) -> list[str]:
    return [str(d) for d in range(2, world + 1) if world % d == 0]


@pytest.mark.parametrize("model_name,clip", [("gpt", 0.5), ("gated", None)])
def test_sharded_layouts_end_with_the_replicated_bits(model_name: str, clip: float | None) -> None:
    """FSDP 2 (resharded after forward or not), FSDP 4 and HSDP 2x2 against the replicated engine at world
    1 and 4: one hash."""
    reference = run_distributed(_train, 1, args=("replicated", model_name, clip), timeout=TIMEOUT)[0]
    replicated4 = run_distributed(_train, 4, args=("replicated", model_name, clip), timeout=TIMEOUT)[0]
    assert replicated4["sha"] == reference["sha"]
    results = {"fsdp 2": run_distributed(_train, 2, args=("2", model_name, clip), timeout=TIMEOUT)}
    results["fsdp 4"] = run_distributed(_train, 4, args=("4", model_name, clip), timeout=TIMEOUT)
    results["hsdp 2x2"] = run_distributed(_train, 4, args=("2", model_name, clip), timeout=TIMEOUT)
    results["fsdp 2, kept"] = run_distributed(_train, 2, args=("2 keep", model_name, clip), timeout=TIMEOUT)
    for name, ranks in results.items():
        assert {r["sha"] for r in ranks} == {reference["sha"]}, name
        assert {r["norm"] for r in ranks} == {reference["norm"]}, name
    if model_name == "gated":  # step 1's micro-batch 3 overflowed micro-batch 0's scale: redone once
        assert {r["redos"] for ranks in results.values() for r in ranks} == {1}


def _uneven(world: int) -> str:
    model = Gated()
    handle = shard(model, ShardPolicy(deterministic=True))
    owned = handle.owned_micro_batches(world + 1)
    try:
        handle.accumulate(lambda b: None, {k: None for k in owned}, num_micro_batches=world + 1, step=0)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_micro_batches_not_a_multiple_of_the_world_are_refused_on_every_rank() -> None:
    messages = run_distributed(_uneven, 2, args=(2,), timeout=TIMEOUT)
    for rank, message in enumerate(messages):
        assert message.startswith(
            f"[rank {rank}/2] accumulate() on a sharded model with 3 micro-batches on 2"
        )
        assert "multiple of the world size" in message


def _float_run(layout: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _gpt()
    batches = _gpt_batches()
    if layout == "replicated":
        handle: Any = replicate(model)
    else:
        handle = shard(model, ShardPolicy(shard_degree=int(layout)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):

        def micro(batch: torch.Tensor) -> None:
            _loss(model, batch, True).backward()

        owned = handle.owned_micro_batches(K)
        handle.accumulate(micro, {k: batches[step * K + k] for k in owned}, num_micro_batches=K, step=step)
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.detach().clone() for k, v in full_tensors(model.state_dict()).items()}
    extras = handle.stats().extras
    return {
        "state": state,
        "between": extras["bytes_communicated_total"],
        "in_group": extras.get("bytes_in_group", 0),
    }


def test_fsdp2s_own_sums_match_the_replicated_run_up_to_rounding() -> None:
    reference = run_distributed(_float_run, 2, args=("replicated",), timeout=TIMEOUT)[0]["state"]
    for layout, world in (("2", 2), ("2", 4)):
        out = run_distributed(_float_run, world, args=(layout,), timeout=TIMEOUT)[0]
        assert out["in_group"] > 0  # FSDP2's collectives went through lockstep's tracked comms
        # between the replica groups: none in FSDP (one group), HSDP's all-reduces in HSDP
        assert (out["between"] > 0) == (world > int(layout)), out["between"]
        for name, value in reference.items():
            torch.testing.assert_close(out["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_default_units_are_the_blocks_and_never_split_tied_parameters() -> None:
    model = TinyGPT(VOCAB, context=16, dim=32, depth=3)
    assert choose_units(model) == list(model.blocks)  # token embedding and head (tied) stay with the root
    with pytest.raises(
        ConfigError, match=r"module 'token' cannot be an FSDP unit of its own: its parameter 'weight'"
    ):
        choose_units(model, {nn.Embedding})
    plain = nn.Sequential(nn.Linear(400, 400), nn.ReLU(), nn.Linear(400, 10), nn.Linear(10, 10))
    assert choose_units(plain) == [plain[0], plain[2], plain[3]]  # three Linear children: repeated blocks
    single = nn.Sequential(nn.Linear(400, 400), nn.ReLU())
    assert choose_units(single, min_params=1000) == [single[0]]  # by size


def test_what_fsdp2_cannot_shard_is_refused_by_name() -> None:
    scalar = nn.Module()
    scalar.scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(
        ConfigError, match=r"the model \(Module\) has a scalar parameter 'scale': FSDP2 shards"
    ):
        check_shardable(scalar)
    sparse = nn.Sequential(nn.Linear(2, 2), nn.Embedding(10, 2, sparse=True))
    with pytest.raises(ConfigError, match=r"module '1' \(Embedding\) makes sparse gradients"):
        check_shardable(sparse)
    check_shardable(TinyGPT(VOCAB, context=16, dim=32, depth=1))  # nothing to refuse


def _live_loop_refused() -> str:
    model = Gated()
    shard(model)
    sampler = MicroBatchSampler(range(8), 2, 2, num_replicas=2, rank=dist.get_rank())
    try:
        LiveLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler)
    except NotSupportedError as e:
        return str(e)
    return "no error"


def test_live_loop_refuses_a_sharded_model_as_the_plan_says() -> None:
    for message in run_distributed(_live_loop_refused, 2, timeout=TIMEOUT):
        assert (
            "LiveLoop replicates the program's model: live recovery of a sharded model is fit's" in message
        ), message


def _degree_refused() -> str:
    try:
        shard(Gated(), ShardPolicy(shard_degree=3))
    except ConfigError as e:
        return str(e)
    return "no error"


def test_a_shard_degree_that_does_not_divide_the_world_is_refused() -> None:
    for message in run_distributed(_degree_refused, 4, timeout=TIMEOUT):
        assert message.startswith("shard_degree=3 does not divide the world size 4"), message
        assert "use a divisor of 4 (1, 2, 4)" in message


def _exact_norm_world() -> float:
    torch.manual_seed(dist.get_rank())
    p = nn.Parameter(torch.zeros(5))
    p.grad = torch.full((5,), 3.0)
    return float(exact_clip_grad_norm_([p], 1.0))


def test_the_exact_norm_of_plain_gradients_needs_no_communication() -> None:
    norms = run_distributed(_exact_norm_world, 2, timeout=TIMEOUT)
    assert norms == [pytest.approx(3.0 * 5**0.5)] * 2


def _float64_and_skipped(layout: str) -> dict[str, Any]:
    """A float64 model (FSDP2 would pre-divide its reduce-scatter input) with a block no forward uses."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(12, 12) for _ in range(3)]).double()
    handle: Any
    if layout == "replicated":
        handle = replicate(model, policy=SyncPolicy(deterministic=True))
    else:
        handle = shard(model, ShardPolicy(shard_degree=int(layout), deterministic=True))
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(3, 12, generator=g, dtype=torch.float64) for _ in range(K)]

    def micro(batch: torch.Tensor) -> None:
        model[1](model[0](batch)).square().mean().backward()  # model[2] is never used

    owned = handle.owned_micro_batches(K)
    handle.accumulate(micro, {k: batches[k] for k in owned}, num_micro_batches=K, step=0)
    unused_grads = [p.grad is None for p in model[2].parameters()]
    grads = {n: full_tensors(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    digest = hashlib.sha256(b"".join(v.contiguous().numpy().tobytes() for v in grads.values())).hexdigest()
    return {"sha": digest, "unused_none": unused_grads, "names": sorted(grads)}


def test_a_float64_model_and_a_block_no_forward_used_match_the_replicated_engine() -> None:
    reference = run_distributed(_float64_and_skipped, 1, args=("replicated",), timeout=TIMEOUT)[0]
    assert reference["unused_none"] == [True, True]
    for ranks in (run_distributed(_float64_and_skipped, 2, args=("2",), timeout=TIMEOUT),):
        for out in ranks:
            assert out["unused_none"] == [True, True]  # no rank ran its unit: no gradient, as replicated
            assert out["names"] == reference["names"] and out["sha"] == reference["sha"]


def _deterministic_alone() -> str:
    try:
        shard(Gated(), ShardPolicy(shard_degree=1, deterministic=True))
    except ConfigError as e:
        return str(e)
    return "no error"


def test_deterministic_sharding_needs_a_shard_group_of_two() -> None:
    for message in run_distributed(_deterministic_alone, 2, timeout=TIMEOUT):
        assert message.startswith("deterministic sharding needs a shard group of 2 or more ranks"), message


def _agreement_and_buffers() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # other weights on each rank: shard() takes rank 0's, as replicate() does
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6), nn.BatchNorm1d(6))
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    shard(model)
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank))  # the buffers drift apart ...
    model.eval()
    model(torch.randn(4, 6)).sum().backward()  # ... and a forward with gradients takes rank 0's again
    state = {n: t.detach().clone() for n, t in full_tensors(model.state_dict()).items()}
    return {"before": before, "after": state}


def test_shard_starts_from_rank_0s_model_and_syncs_buffers_like_ddp() -> None:
    ranks = run_distributed(_agreement_and_buffers, 2, timeout=TIMEOUT)
    zero, one = ranks
    for name, value in zero["before"].items():
        if "running_mean" in name and name.startswith("1."):
            assert torch.equal(one["after"][name], torch.zeros(6)), name  # rank 0's value, 0.0
            continue
        assert torch.equal(one["after"][name], value), name  # rank 0's starting model everywhere
        assert torch.equal(zero["after"][name], value), name


def _nan_norm() -> float:
    torch.manual_seed(0)
    model = Gated()
    shard(model)
    for p in model.parameters():
        p.grad = torch.distributed.tensor.DTensor.from_local(
            torch.ones_like(p.to_local()), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
    if dist.get_rank() == 1:
        next(model.parameters()).grad.to_local().view(-1)[0] = float("nan")
    return float(exact_clip_grad_norm_(model.parameters(), 1.0))


def test_a_nan_on_one_shard_makes_every_ranks_norm_nan() -> None:
    norms = run_distributed(_nan_norm, 2, timeout=TIMEOUT)
    assert all(n != n for n in norms), norms
