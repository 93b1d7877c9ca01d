"""Streaming DiLoCo's fragment layouts (engine/periodic/fragments.py) and DiLoCo's outer momentum ramp.

strided: layer i (a module's own parameters) in fragment i mod F; sliced: every parameter's rows in F
blocks, the fragments of equal size, each a view that writes through to its parameter; contiguous:
runs of about equal size (fragment_bounds).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lockstep
from lockstep.engine.periodic.fragments import Part, layout_fragments
from lockstep.engine.periodic.outer_sync import OuterSync
from lockstep.errors import ConfigError
from lockstep.jobs.models import TinyGPT


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(96, context=64, dim=64, depth=2)


def _sizes(params: list[torch.Tensor], fragments: list[list[Part]]) -> list[int]:
    return [sum(part.view(params).numel() for part in fragment) for fragment in fragments]


def test_strided_deals_the_layers_out_in_turn() -> None:
    model = _gpt()
    params = list(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    fragments = layout_fragments(model, params, 4, "strided")
    layer_of = [[names[id(params[part.index])].rsplit(".", 1)[0] for part in f] for f in fragments]
    # 15 layers in named_modules' order: the model's own (position), token, then per block ln1, ln2, qkv,
    # proj, mlp.0, mlp.2, then norm (the head's weight is the token's: counted once); fragment 0 has 0, 4, 8, 12
    assert layer_of[0] == ["position", "blocks.0.attn.qkv", "blocks.0.attn.qkv", "blocks.1.ln1", "blocks.1.ln1",
                           "blocks.1.mlp.0", "blocks.1.mlp.0"]  # fmt: skip
    assert sorted(part.index for f in fragments for part in f) == list(range(len(params)))
    assert all(part.stop is None for f in fragments for part in f)  # whole parameters


def test_sliced_fragments_are_equal_and_write_through() -> None:
    model = _gpt()
    params = list(model.parameters())
    fragments = layout_fragments(model, params, 4, "sliced")
    total = sum(p.numel() for p in params)
    assert _sizes(params, fragments) == [total // 4] * 4  # every row count here divides by 4
    view = fragments[2][0].view(params)
    with torch.no_grad():
        view.fill_(7.0)
    assert params[0].detach()[fragments[2][0].start : fragments[2][0].stop].eq(7.0).all()
    assert not params[0].detach()[: fragments[2][0].start].eq(7.0).any()


def test_contiguous_is_the_old_layout_and_bad_counts_are_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    assert [[p.index for p in f] for f in layout_fragments(model, params, 2, "contiguous")] == [
        [0, 1],
        [2, 3],
    ]
    # fewer layers than fragments: the parameters are dealt out
    assert [[p.index for p in f] for f in layout_fragments(model, params, 3, "strided")] == [[0, 3], [1], [2]]
    with pytest.raises(ConfigError, match="1 to 4 fragments"):
        layout_fragments(model, params, 5, "strided")
    with pytest.raises(ConfigError, match="fragment_layout must be one of strided, sliced, contiguous"):
        layout_fragments(model, params, 2, "diagonal")


def test_a_streaming_replica_syncs_a_quarter_of_the_model_at_a_time_when_sliced() -> None:
    model = _gpt()
    policy = lockstep.SyncPolicy(sync="streaming_diloco", sync_every=4, fragments=4, fragment_layout="sliced")
    outer = OuterSync(model, policy, None, world=1)
    total = sum(p.numel() for p in model.parameters())
    assert [sum(a.numel() for a in piece.anchor) for piece in outer.pieces] == [total // 4] * 4


def test_the_outer_momentum_rises_over_its_warmup_and_resumes_where_it_was() -> None:
    model = nn.Linear(2, 2)
    policy = lockstep.SyncPolicy(sync="diloco", sync_every=1, outer_momentum=0.9, outer_momentum_warmup=4)
    outer = OuterSync(model, policy, None, world=1)
    seen = []
    for _ in range(3):
        outer.after_optimizer_step()
        seen.append(outer.outer[0].param_groups[0]["momentum"])
    assert seen == pytest.approx([0.0, 0.9 / 4, 0.9 / 2])
    again = OuterSync(nn.Linear(2, 2), policy, None, world=1)
    again.load_state_dict(outer.state_dict())
    for _ in range(3):
        again.after_optimizer_step()
        seen.append(again.outer[0].param_groups[0]["momentum"])
    assert seen[3:] == pytest.approx([0.9 * 3 / 4, 0.9, 0.9])
    flat = OuterSync(
        nn.Linear(2, 2), lockstep.SyncPolicy(sync="diloco", outer_momentum_warmup=0), None, world=1
    )
    assert flat.algorithm.momentum_at(1, 0.9) == 0.9
