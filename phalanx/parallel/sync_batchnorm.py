"""Synchronised batch normalisation on any backend (torch's own SyncBatchNorm needs a GPU).

Batch statistics are computed over the global batch: every rank contributes its
per-channel sum, sum of squares and count in one allreduce; backward allreduces
the two per-channel sums the input gradient needs (Ioffe & Szegedy 2015, with
the cross-device reduction of Peng et al. 2018, "MegDet").

    forward   local (Σx, Σx², n) ──allreduce──▶ mean, var ──▶ y = (x-mean)/σ·γ + β
    backward  local (Σdy, Σdy·x̂) ──allreduce──▶ dx = γ/σ·(dy - mean(dy) - x̂·mean(dy·x̂))

Weight and bias gradients stay local, as in torch's SyncBatchNorm; the data-parallel
engine averages them with every other gradient.

Example::

    model = phalanx.SyncBatchNorm.convert_sync_batchnorm(model)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from phalanx.comm.horovod_ops.process_sets import group_of

__all__ = ["SyncBatchNorm"]


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        channels = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        x32 = x.float()
        count = torch.tensor([x.numel() / channels], dtype=torch.float32, device=x.device)
        stats = torch.cat([x32.sum(dims), (x32 * x32).sum(dims), count])
        dist.all_reduce(stats, group=group)
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * total / (total - 1).clamp_min(1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (x32 - mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.float().view(shape) + bias.float().view(shape)
        ctx.save_for_backward(xhat, invstd, weight, total)
        ctx.group = group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        xhat, invstd, weight, total = ctx.saved_tensors
        channels = xhat.shape[1]
        dims = [d for d in range(xhat.dim()) if d != 1]
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        dy = grad_y.float()
        local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])
        grad_weight = local[channels:].clone() if weight is not None else None
        grad_bias = local[:channels].clone() if weight is not None else None
        dist.all_reduce(local, group=ctx.group)
        mean_dy = (local[:channels] / total).view(shape)
        mean_dy_xhat = (local[channels:] / total).view(shape)
        scale = invstd.view(shape)
        if weight is not None:
            scale = scale * weight.float().view(shape)
        grad_x = scale * (dy - mean_dy - xhat * mean_dy_xhat)
        if weight is not None:
            grad_weight, grad_bias = grad_weight.to(weight.dtype), grad_bias.to(weight.dtype)
        return grad_x.to(grad_y.dtype), grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics span every rank of ``group`` (default: the world).

    ``process_set=`` (a :class:`phalanx.comm.horovod_ops.process_sets.ProcessSet`, Horovod's spelling) is
    accepted instead of ``group``; only its members may run the module.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, group=None,
                 process_set=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        if process_set is not None:  # Horovod's spelling: statistics over the members of a process set
            if group is not None:
                raise ValueError("SyncBatchNorm: pass group= or process_set=, not both")
            group = group_of(process_set)
        self.group = group

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch_stats = self.training or not self.track_running_stats
        synced = use_batch_stats and dist.is_initialized() and dist.get_world_size(self.group) > 1
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        if not synced:
            return F.batch_norm(
                x,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, use_batch_stats, momentum, self.eps,
            )
        running = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(
            x, self.weight, self.bias,
            self.running_mean if running else None, self.running_var if running else None,
            self.eps, momentum, self.group,
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, group=None) -> nn.Module:
        """Replace every BatchNorm*d in ``module`` by a SyncBatchNorm with the same state."""
        out = module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, group)
            if module.affine:
                with torch.no_grad():
                    out.weight.copy_(module.weight)
                    out.bias.copy_(module.bias)
            if module.track_running_stats:
                out.running_mean, out.running_var = module.running_mean, module.running_var
                out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, group))
        return out
