"""SyncBatchNorm on gloo: two half-batches give the full batch's outputs, gradients and running stats."""

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.parallel.sync_batchnorm import SyncBatchNorm
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 4, 4, generator=g), torch.randn(8, 3, 4, 4, generator=g)


def _model():
    torch.manual_seed(1)
    m = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    with torch.no_grad():
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.uniform_(-0.5, 0.5)
    return m


def _sync_bn_half_batch():
    x, dy = _data()
    r, n = px.rank(), px.size()
    per = len(x) // n
    model = SyncBatchNorm.convert_sync_batchnorm(_model())
    xs = x[r * per:(r + 1) * per].clone().requires_grad_()
    y = model(xs)
    y.backward(dy[r * per:(r + 1) * per])
    grads = {k: px.allreduce(p.grad, op=px.Sum) for k, p in model.named_parameters()}
    return y.detach(), xs.grad, grads, model[1].running_mean.clone(), model[1].running_var.clone()


def test_sync_batchnorm_matches_full_batch_reference():
    x, dy = _data()
    ref = _model()
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(dy)
    for r, (y, gx, grads, rm, rv) in enumerate(distributed(_sync_bn_half_batch, np=2)):
        torch.testing.assert_close(y, yr.detach()[r * 4:(r + 1) * 4], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gx, xr.grad[r * 4:(r + 1) * 4], atol=1e-5, rtol=1e-5)
        for k, p in ref.named_parameters():  # summed local grads == full-batch grads
            torch.testing.assert_close(grads[k], p.grad, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(rm, ref[1].running_mean, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(rv, ref[1].running_var, atol=1e-6, rtol=1e-5)


def test_world_of_one_and_eval_fall_back_to_plain_batchnorm():
    px.init()
    try:
        ref, model = _model(), SyncBatchNorm.convert_sync_batchnorm(_model())
        x, _ = _data()
        torch.testing.assert_close(model(x), ref(x))
        model.eval()
        ref.eval()
        torch.testing.assert_close(model(x), ref(x))
    finally:
        px.shutdown()
