"""SyncBatchNorm on any device and backend: batch statistics shared across ranks in forward and backward.

torch.nn.SyncBatchNorm refuses CPU tensors (and torch's DDP refuses it on CPU modules), so data-parallel
training with BatchNorm on gloo silently normalizes with per-rank statistics. This layer computes the
statistics of the whole (possibly uneven) global batch on every backend torch.distributed offers.

Communication, per layer and step (training mode, world size > 1):
  forward:  one all-reduce of [sum x (C), sum x^2 (C), count (1)], packed, float64;
  backward: one all-reduce of [sum dy (C), sum dy*x_hat (C)], packed, float64, only when the
            input needs a gradient (as in torch).
Eval mode communicates nothing (running statistics, or per-rank batch statistics when
track_running_stats=False, exactly like torch).

Why float64 on the wire: the global variance is E[x^2] - E[x]^2 of sums from every rank, which cancels
catastrophically in float32 when |mean| >> std (mean/std = 1e4 leaves no correct digit). Each rank
first computes its own mean and centred second moment in float32 with torch.var_mean (stable), and
only the cross-rank combination runs in float64: relative error about 1e-16 * (mean/std)^2. The cost
is 2C+1 doubles per layer, and an all-reduce (not torch's all-gather) keeps it independent of world
size while still handling unequal counts, since sums add where means do not.

Inputs in float16/bfloat16 are normalized in float32 and returned in their own dtype; parameter
gradients come back in the parameters' dtype. A rank with an empty batch still joins both collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from lockstep.engine.deterministic.running_stats import in_micro_batch_statistics
from lockstep.errors import ConfigError, rank_tag
from lockstep.runtime.collectives import comm_device
from lockstep.runtime.waits import tracked, wait_watching_membership
from lockstep.torch_private import BatchNormBase

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

_WIRE_DTYPE = torch.float64


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """View a (C,) tensor so that it broadcasts against x of shape (N, C, ...)."""
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _to_wire(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Device first, then dtype: some devices (mps) have no float64.
    return t.to(device).to(_WIRE_DTYPE)


def _from_wire(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.dtype).to(like.device)


def _local_moments(xc: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[sum x, sum x^2, count] of this rank, packed, from a stable float32 mean and centred variance."""
    channels = xc.shape[1]
    count = xc.numel() // channels
    if count == 0:
        return torch.zeros(2 * channels + 1, dtype=_WIRE_DTYPE, device=device)
    var, mean = torch.var_mean(xc, dim=_reduce_dims(xc), correction=0)
    mean64, var64 = _to_wire(mean, device), _to_wire(var, device)
    counts = torch.full((1,), float(count), dtype=_WIRE_DTYPE, device=device)
    return torch.cat([mean64 * count, (var64 + mean64 * mean64) * count, counts])


def _all_reduce(packed: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    with tracked("allreduce (SyncBatchNorm statistics)", (packed,), group):
        wait_watching_membership(dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group, async_op=True))
    return packed


def _global_count(total: float, group: dist.ProcessGroup) -> float:
    # Every rank sees the same total after the all-reduce, so every rank raises together: no hang.
    if total <= 1:
        world = dist.get_world_size(group)
        raise ConfigError(
            f"{rank_tag(dist.get_rank(group), world)}SyncBatchNorm saw {int(total)!r} value(s) per channel "
            f"across all {world} ranks of its process group, expected more than 1 when training: enlarge "
            "the batch or call model.eval() for such steps"
        )
    return total


def _update_running(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    count: float,
    momentum: float,
) -> None:
    """torch's rule: running = (1 - momentum) * running + momentum * batch, with the unbiased variance."""
    unbiased = var * (count / (count - 1))
    running_mean.mul_(1.0 - momentum).add_(_from_wire(mean, running_mean), alpha=momentum)
    running_var.mul_(1.0 - momentum).add_(_from_wire(unbiased, running_var), alpha=momentum)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm whose statistics, and the statistics' gradients, are summed over a process group.

    The element-wise passes run in torch's own batch_norm kernels in eval form (given mean and var),
    which every device implements: forward = 1 pass for local moments + 1 normalizing pass; backward
    = 1 fused reduction pass + 2 element-wise passes. Only the per-channel algebra is ours.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        device = comm_device(group)
        xc = x.to(_compute_dtype(x))
        packed = _all_reduce(_local_moments(xc, device), group)  # the one forward collective
        channels = xc.shape[1]
        count = _global_count(float(packed[-1].item()), group)
        mean = packed[:channels] / count
        var = (packed[channels : 2 * channels] / count - mean * mean).clamp_(min=0.0)
        if running_mean is not None and running_var is not None:
            _update_running(running_mean, running_var, mean, var, count, momentum)
        mean_c, var_c = _from_wire(mean, xc), _from_wire(var, xc)
        out = _affine_normalize(xc, mean_c, var_c, _cast(weight, xc), _cast(bias, xc), eps)
        ctx.save_for_backward(x, weight, mean_c, var_c)  # type: ignore[arg-type]  # None is allowed
        ctx.count = count  # type: ignore[attr-defined]
        ctx.eps = eps  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        ctx.bias_dtype = None if bias is None else bias.dtype  # type: ignore[attr-defined]
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean_c, var_c = ctx.saved_tensors
        xc, g = x.to(mean_c.dtype), grad_out.to(mean_c.dtype)
        sum_dy, sum_dy_xhat = _local_grad_sums(g, xc, mean_c, var_c, ctx.eps)
        grad_weight = grad_bias = grad_input = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            grad_input = _input_grad(g, xc, weight, mean_c, var_c, sum_dy, sum_dy_xhat, ctx).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _cast(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.to(like.dtype)


def _affine_normalize(
    xc: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * scale + shift per channel, in one native pass (all one dtype)."""
    return F.batch_norm(xc, mean, var, scale, shift, False, 0.0, eps)


def _local_grad_sums(
    g: torch.Tensor, xc: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sum(dy) and sum(dy * x_hat) per channel, in one fused pass; zeros for an empty batch."""
    if xc.numel() == 0:  # the native kernel divides by the element count (SIGFPE on CPU)
        zeros = torch.zeros(xc.shape[1], dtype=xc.dtype, device=xc.device)
        return zeros, zeros.clone()
    if xc.device.type == "cuda":
        # CUDA's native_batch_norm_backward asserts on save_mean in eval form (seen on an H100, torch
        # 2.11); torch's SyncBatchNorm uses this reduction kernel instead: sum(dy), sum(dy * (x - mean)).
        invstd = torch.rsqrt(var + eps)
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
            g, xc, mean, invstd, None, True, False, False
        )
        return sum_dy, sum_dy_xmu * invstd
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        g, xc, None, mean, var, None, None, False, eps, [False, True, True]
    )
    return sum_dy, sum_dy_xhat


def _input_grad(
    g: torch.Tensor,
    xc: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    sum_dy: torch.Tensor,
    sum_dy_xhat: torch.Tensor,
    ctx: Any,
) -> torch.Tensor:
    """dx = w * invstd * (dy - mean(dy) - x_hat * mean(dy * x_hat)), with means over the whole group."""
    channels = sum_dy.shape[0]
    device = comm_device(ctx.group)
    local = torch.cat([_to_wire(sum_dy, device), _to_wire(sum_dy_xhat, device)])
    packed = _all_reduce(local, ctx.group)  # the one backward collective
    mean_dy = _from_wire(packed[:channels] / ctx.count, mean)
    mean_dy_xhat = _from_wire(packed[channels:] / ctx.count, mean)
    w_invstd = torch.rsqrt(var + ctx.eps)
    if weight is not None:
        w_invstd = w_invstd * weight.to(mean.dtype)
    # x_hat * (-w invstd mean(dy x_hat)) - w invstd mean(dy) in one native pass, then + w invstd * dy.
    grad = _affine_normalize(xc, mean, var, -w_invstd * mean_dy_xhat, -w_invstd * mean_dy, ctx.eps)
    return grad.addcmul_(g, _per_channel(w_invstd, g))


class SyncBatchNorm(BatchNormBase):
    """Drop-in for torch.nn.SyncBatchNorm that also works on CPU/gloo (any device, any backend).

    Input (N, C, *): 2D to 5D and beyond. In training mode with a process group of more than one rank,
    mean and variance are those of the concatenated batch of every rank in `process_group` (default:
    the whole world), in forward and backward, with exactly one packed all-reduce per forward and one
    per backward per layer; per-rank batch sizes may differ, and may be 0 (that rank still joins both
    collectives). Running statistics get the unbiased global variance, as in torch. Without a process
    group, or in a group of one, it is plain BatchNorm. Eval mode never communicates.

    Parameter gradients are this rank's share (the gradient of its own loss), like torch: the
    data-parallel engine sums/averages them across ranks. Not a subclass of torch.nn.SyncBatchNorm
    on purpose: torch's DDP rejects that class on CPU modules.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        # Only pass bias when it changes something: torch < 2.5 has no such argument.
        extra: dict[str, Any] = {} if bias else {"bias": False}
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **extra
        )
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ConfigError(
                f"SyncBatchNorm expected an input of shape (N, C, ...) with at least 2 dimensions, got shape "
                f"{tuple(input.shape)!r}: add a batch dimension, e.g. input.unsqueeze(0)"
            )
        if input.size(1) != self.num_features:
            raise ConfigError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.size(1)!r} channels "
                f"(shape {tuple(input.shape)!r}); expected dimension 1 to be {self.num_features}: "
                "check the layer's num_features against the previous layer's output"
            )

    def _sync_group(self) -> dist.ProcessGroup | None:
        """The group to synchronize over, or None when there is nobody to synchronize with."""
        if in_micro_batch_statistics() or not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ConfigError(
                f"{rank_tag(dist.get_rank(), dist.get_world_size())}SyncBatchNorm({self.num_features}) ran "
                "a training forward on a rank that is not a member of its process_group, expected only "
                "the group's members to train it: give this rank's model its own group (see "
                "convert_sync_batchnorm(module, process_group)) or keep the layer in eval mode here"
            )
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked.item())
        # Batch statistics in training, and in eval when there are no running statistics (torch's rule).
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        group = self._sync_group() if self.training else None  # never communicate in eval mode
        if group is None:
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps
            )
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group
        )

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> torch.nn.Module:
        """Replace every BatchNorm layer in `module` with this class (see convert_sync_batchnorm)."""
        return convert_sync_batchnorm(module, process_group, layer_class=cls)


def convert_sync_batchnorm(
    module: torch.nn.Module,
    process_group: dist.ProcessGroup | None = None,
    *,
    layer_class: type[SyncBatchNorm] = SyncBatchNorm,
) -> torch.nn.Module:
    """Recursively replace every _BatchNorm layer (BatchNorm1d/2d/3d, torch's SyncBatchNorm, ...) by SyncBatchNorm.

    Like torch.nn.SyncBatchNorm.convert_sync_batchnorm: the new layers share the old ones' parameters
    (same objects, so requires_grad and optimizer references hold) and buffers, keep the training
    flag and qconfig, and state_dict keys do not change. Returns `module`, or the new layer when
    `module` itself is a BatchNorm layer.
    """
    converted = module
    if isinstance(module, BatchNormBase):
        converted = _convert_layer(module, process_group, layer_class)
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group, layer_class=layer_class))
    return converted


def _convert_layer(
    layer: BatchNormBase, process_group: dist.ProcessGroup | None, layer_class: type[SyncBatchNorm]
) -> SyncBatchNorm:
    new = layer_class(
        layer.num_features,
        layer.eps,
        layer.momentum,
        layer.affine,
        layer.track_running_stats,
        process_group,
        bias=layer.bias is not None or not layer.affine,
    )
    if layer.affine:
        with torch.no_grad():
            new.weight = layer.weight
            new.bias = layer.bias
    new.running_mean = layer.running_mean
    new.running_var = layer.running_var
    new.num_batches_tracked = layer.num_batches_tracked
    new.training = layer.training
    if hasattr(layer, "qconfig"):
        new.qconfig = layer.qconfig
    return new
