"""Local SGD on real ranks: H=1 == synchronous DP, post-local warm-up, DiLoCo, time-based periods,
digits accuracy."""

import time

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.demo import load_digits
from phalanx.ps import DiLoCo, LocalSGD
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

STEPS, BATCH, EPOCHS = 6, 32, 5


def _mlp(hidden=32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _train(model, opt, steps, batch, epochs=1):
    x, y, xt, yt = load_digits()
    r, n = px.rank(), px.size()
    local = batch // n
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps or len(x) // batch):
            idx = order[step * batch + r * local :][:local]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        return (model(xt).argmax(1) == yt).float().mean().item()


def _suite():
    out = {}
    # H=1 with plain SGD: averaging parameters after each step == averaging gradients
    model = _mlp()
    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=1)
    _train(model, opt, STEPS, BATCH)
    out["h1"] = [p.detach().clone() for p in model.parameters()]
    # post-local SGD: the warm-up is exact DP even with momentum; then H=3 local steps
    model = _mlp()
    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, sync_every=3,
                   warmup_steps=STEPS)
    _train(model, opt, STEPS, BATCH)
    out["warm"] = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 7, BATCH)
    out["warm_stats"] = opt.stats
    # DiLoCo: after the first sync, params == anchor - outer_lr * (anchor - average) (no momentum yet)
    model = _mlp()
    start = [p.detach().clone() for p in model.parameters()]
    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=2,
                   outer=DiLoCo(lr=0.7, momentum=0.9, nesterov=False))
    plain = _mlp()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    _train(model, opt, 2, BATCH)
    _train(plain, plain_opt, 2, BATCH)  # the same two local steps, without averaging
    local = [px.allreduce(p.detach().clone(), op=px.Average) for p in plain.parameters()]
    out["diloco"] = [(p.detach().clone(), s - 0.7 * (s - avg)) for p, s, avg in zip(model.parameters(), start, local)]
    # time-based periods: rank 1's steps (60 ms) outlast the 40 ms period, rank 0's (5 ms) do not;
    # both average exactly 4 times, after different numbers of local steps, and end equal
    model = _mlp()
    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every_s=0.04)
    x, y, _, _ = load_digits()
    synced_at = []
    while opt.stats.syncs < 4:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
        time.sleep(0.005 if px.rank() == 0 else 0.06)
        opt.step()
        if opt.synced:
            synced_at.append(opt.stats.steps)
    out["timed"] = (synced_at, [p.detach().clone() for p in model.parameters()])
    # convergence on digits: sync DP (H=1, no momentum difference) vs local SGD H=8 vs DiLoCo
    for name, kw in (("sync", {"sync_every": 1, "warmup_steps": 10**9}), ("local", {"sync_every": 8}),
                     ("post", {"sync_every": 8, "warmup_steps": 40})):
        model = _mlp(64)
        opt = LocalSGD(torch.optim.Adam(model.parameters(), lr=3e-3), model, **kw)
        _train(model, opt, 0, 64, epochs=EPOCHS)
        opt.synchronize()
        out[f"acc_{name}"] = _train(model, opt, 0, 64, epochs=0)
        out[f"stats_{name}"] = opt.stats
    return out


def _reference(momentum=0.0):
    model, (x, y, _, _) = _mlp(), load_digits()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        idx = order[step * BATCH :][:BATCH]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_local_sgd_on_two_ranks():
    results = distributed(_suite, np=2, timeout=180)
    ref_plain, ref_momentum = _reference(), _reference(0.9)
    for out in results:
        for got, want in zip(out["h1"], ref_plain):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        for got, want in zip(out["warm"], ref_momentum):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        st = out["warm_stats"]
        assert (st.steps, st.grad_syncs, st.syncs) == (STEPS + 7, STEPS, 7 // 3)
        for got, want in out["diloco"]:
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    (fast_at, fast_params), (slow_at, slow_params) = results[0]["timed"], results[1]["timed"]
    assert slow_at == [1, 2, 3, 4] and len(fast_at) == 4 and fast_at[-1] > 4, (fast_at, slow_at)
    for a, b in zip(fast_params, slow_params):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for r in (1,):  # every replica ends equal after synchronize()
        assert results[r]["acc_local"] == results[0]["acc_local"]
    acc = {m: results[0][f"acc_{m}"] for m in ("sync", "local", "post")}
    assert acc["sync"] > 0.9, acc
    assert acc["local"] >= acc["sync"] - 0.02 and acc["post"] >= acc["sync"] - 0.02, acc
    # H=8 sends ~8x fewer bytes than averaging every step
    sent = {m: results[0][f"stats_{m}"].bytes_sent for m in ("sync", "local")}
    assert sent["sync"] > 6 * sent["local"], sent


def test_bad_arguments():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sync_every"):
        LocalSGD(opt, model, sync_every=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        LocalSGD(opt, model, warmup_steps=-1)
    with pytest.raises(ValueError, match="not both"):
        LocalSGD(opt, model, sync_every=4, sync_every_s=1.0)
    with pytest.raises(ValueError, match="sync_every_s must be > 0"):
        LocalSGD(opt, model, sync_every_s=0)
