"""convert_sync_batchnorm and SyncBatchNorm without a process group: torch's contract, no communication."""

from __future__ import annotations

import inspect

import pytest
import torch

from lockstep.nn import SyncBatchNorm, convert_sync_batchnorm


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.BatchNorm2d(4),
        torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(4 * 36, 5), torch.nn.BatchNorm1d(5, affine=False)
        ),
        torch.nn.BatchNorm1d(5, momentum=None, eps=1e-3),
        torch.nn.BatchNorm1d(5, track_running_stats=False),
        torch.nn.SyncBatchNorm(5, bias=False),  # torch's own: converted too
    )
    model[1].weight.requires_grad_(False)  # frozen scale: must stay frozen
    model[3].eval()
    with torch.no_grad():
        model[1].running_mean.uniform_()
        model[1].weight.uniform_()
        model[1].num_batches_tracked.fill_(7)
    model[2][2].qconfig = "sentinel-qconfig"
    return model


def test_converts_every_batchnorm_and_keeps_weights_buffers_and_flags() -> None:
    model = _model()
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_params = {name: p for name, p in model.named_parameters()}
    before_buffers = {name: b for name, b in model.named_buffers()}
    x = torch.randn(6, 3, 8, 8)
    model.eval()
    expected = model(x)
    model.train()
    model[3].eval()
    group = object()  # stored, never used without a process group

    out = convert_sync_batchnorm(model, process_group=group)

    assert out is model
    converted = [model[1], model[2][2], model[3], model[4], model[5]]
    assert all(type(m) is SyncBatchNorm and m.process_group is group for m in converted)
    assert [type(m).__name__ for m in model.modules()].count("SyncBatchNorm") == 5
    assert dict(model.named_parameters()).keys() == before_params.keys()
    assert all(p is before_params[name] for name, p in model.named_parameters())  # optimizer refs hold
    assert all(b is before_buffers[name] for name, b in model.named_buffers())
    assert model[1].weight.requires_grad is False and model[1].bias.requires_grad is True
    assert [m.training for m in converted] == [True, True, False, True, True]
    assert model[2][2].qconfig == "sentinel-qconfig"
    assert model[2][2].weight is None and model[5].bias is None and model[5].weight is not None
    assert model[4].running_mean is None and model[3].momentum is None and model[3].eps == 1e-3
    assert model.state_dict().keys() == before_state.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before_state[name]), name
    model.eval()
    torch.testing.assert_close(model(x), expected, atol=0, rtol=0)


def test_bare_layer_classmethod_and_models_without_batchnorm() -> None:
    bn = torch.nn.BatchNorm3d(2)
    new = SyncBatchNorm.convert_sync_batchnorm(bn)
    assert type(new) is SyncBatchNorm and new is not bn and new.weight is bn.weight
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    assert convert_sync_batchnorm(plain) is plain and type(plain[0]) is torch.nn.Linear

    class Mine(SyncBatchNorm):
        pass

    assert type(Mine.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))[0]) is Mine


def test_constructor_signature_matches_torch() -> None:
    ours = inspect.signature(SyncBatchNorm.__init__).parameters
    theirs = inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters
    ours = {n: p for n, p in ours.items() if n in theirs or n != "bias"}  # torch < 2.5 has no `bias`
    assert [(n, p.default, p.kind) for n, p in ours.items()] == [
        (n, p.default, p.kind) for n, p in theirs.items()
    ]
    layer = SyncBatchNorm(3, dtype=torch.float64)
    assert layer.weight.dtype == torch.float64 and layer.running_var.dtype == torch.float64


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 5), (3, 4, 2, 3), (2, 4, 2, 2, 3)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_process_group_it_is_batchnorm(shape: tuple[int, ...], momentum: float | None) -> None:
    ours = SyncBatchNorm(4, momentum=momentum)
    theirs = torch.nn.SyncBatchNorm(4, momentum=momentum)  # falls back to batch_norm without a group
    theirs.load_state_dict(ours.state_dict())
    for step in range(3):
        x = torch.randn(*shape) + step
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa), theirs(xb)
        r = torch.randn_like(ya)
        (ya * r).sum().backward()
        (yb * r).sum().backward()
        for a, b in [
            (ya, yb),
            (xa.grad, xb.grad),
            (ours.weight.grad, theirs.weight.grad),
            (ours.bias.grad, theirs.bias.grad),
        ]:
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], value, atol=0, rtol=0)
    ours.eval()
    theirs.eval()
    x = torch.randn(*shape)
    torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=0)


def test_state_dict_is_interchangeable_with_torch() -> None:
    theirs = torch.nn.SyncBatchNorm(3)
    theirs.running_mean.fill_(2.0)
    ours = SyncBatchNorm(3)
    ours.load_state_dict(theirs.state_dict())  # strict
    assert torch.equal(ours.running_mean, theirs.running_mean)
    torch.nn.SyncBatchNorm(3).load_state_dict(ours.state_dict())


def test_bad_inputs_say_what_was_seen() -> None:
    layer = SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"at least 2 dimensions, got shape \(3,\)"):
        layer(torch.randn(3))
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(3\) got an input with 4 channels"):
        layer(torch.randn(2, 4))
