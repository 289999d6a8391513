"""Online bucket autotuning attached to the gradient engine (``phalanx run --autotune``)."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

GRID = (0.001, 0.01, 1.0)  # MB: many tiny buckets, a few, one


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _tuned_training(log_file):
    from phalanx.planner import autotune

    env = {"PHALANX_AUTOTUNE": "1", "PHALANX_AUTOTUNE_BUCKETS_MB": ",".join(map(str, GRID)),
           "PHALANX_AUTOTUNE_WARMUP_STEPS": "1", "PHALANX_AUTOTUNE_STEPS_PER_TRIAL": "2",
           "PHALANX_AUTOTUNE_ROUNDS": "1", "PHALANX_AUTOTUNE_SETTLE_STEPS": "0", "PHALANX_AUTOTUNE_LOG": log_file}
    assert autotune.enable_from_env(env)
    r, n, b = px.rank(), px.size(), 4
    ref, dp = _mlp(), px.DataParallel(_mlp())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_dp = torch.optim.SGD(dp.parameters(), lr=0.05, momentum=0.9)
    sizes = []
    for step in range(12):  # 1 warm-up + 3 candidates x 2 steps, then the kept setting
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(n * b, 16, generator=g), torch.randint(0, 4, (n * b,), generator=g)
        for model, opt, xs, ys in ((ref, opt_ref, x, y), (dp, opt_dp, x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
        sizes.append(len(dp._engine.buckets.buckets))
    tuner = dp._engine.autotuner
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), dp.module.parameters()))
    return {"done": tuner.done, "best": tuner.best, "tried": [c for c, _ in tuner.log],
            "bucket_bytes": dp._engine.buckets.bucket_bytes, "bucket_counts": sizes, "diff": diff}


def test_autotune_searches_the_grid_agrees_and_keeps_training_exact(tmp_path):
    log_file = str(tmp_path / "autotune.csv")
    results = distributed(_tuned_training, np=2, args=(log_file,), timeout=120)
    for out in results:
        assert out["done"], out
        assert out["tried"] == [(mb, "flat") for mb in GRID]
        assert out["best"] == results[0]["best"]  # every rank keeps the same setting
        assert out["bucket_bytes"] == int(out["best"][0] * 2**20)
        assert len(set(out["bucket_counts"])) > 1  # the layout really changed during the search
        assert out["diff"] < 1e-5  # re-bucketing mid-training does not change the update
    rows = open(log_file).read().splitlines()
    assert rows[0] == "bucket_mb,algorithm,seconds_per_step,trials,chosen"
    assert len(rows) == 1 + len(GRID) and sum(row.endswith(",best") for row in rows) == 1


def test_phalanx_run_autotune_flag(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, phalanx as px
        px.init()
        model = px.DataParallel(torch.nn.Linear(32, 32))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(6):
            opt.zero_grad(); model(torch.randn(4, 32)).sum().backward(); opt.step()
        print("best", model._engine.autotuner.best)
    """))
    log_file = tmp_path / "search.csv"
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--autotune", "--autotune-log-file", str(log_file),
           "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "1", sys.executable, str(script)]
    env = dict(__import__("os").environ, PHALANX_AUTOTUNE_BUCKETS_MB="0.001,1", PHALANX_AUTOTUNE_ROUNDS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "[0]: best" in proc.stdout and "[1]: best" in proc.stdout
    assert len(log_file.read_text().splitlines()) == 3

    bad = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", "--autotune-log-file", "x",
                          sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "need --autotune" in bad.stderr


def _reform_keeps_the_result():
    from phalanx.parallel.data.gradients import reform_engines
    from phalanx.planner import autotune

    env = {"PHALANX_AUTOTUNE": "1", "PHALANX_AUTOTUNE_BUCKETS_MB": ",".join(map(str, GRID)),
           "PHALANX_AUTOTUNE_WARMUP_STEPS": "1", "PHALANX_AUTOTUNE_STEPS_PER_TRIAL": "2",
           "PHALANX_AUTOTUNE_ROUNDS": "1", "PHALANX_AUTOTUNE_SETTLE_STEPS": "0"}
    assert autotune.enable_from_env(env)

    def build():  # DistributedOptimizer: no collective at construction, so one rank may build alone
        net = _mlp()
        return net, px.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                            named_parameters=net.named_parameters())

    net, opt = build()
    opt._engine.autotuner.adopt((GRID[-1], "flat"))  # the old ranks' search ended on 1 MB (one bucket)
    before = None
    if px.rank() == 1:  # a newcomer: a fresh engine whose tuner starts its search at 0.001 MB
        net, opt = build()
        before = (opt._engine.autotuner.done, opt._engine.buckets.bucket_bytes)
    reform_engines(px.topology())  # every rank, right after a re-form (phalanx.elastic.run does it)
    tuner = opt._engine.autotuner
    after = {"done": tuner.done, "best": tuner.best, "bucket_bytes": opt._engine.buckets.bucket_bytes}
    for step in range(8):  # past a trial's end: a tuner still searching on one rank alone would hang here
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return {"before": before, "after": after, "params": [p.detach().clone() for p in net.parameters()]}


def test_a_reform_keeps_the_autotuned_size_and_a_newcomer_takes_it():
    out = distributed(_reform_keeps_the_result, np=2, timeout=120)
    assert out[1]["before"] == (False, int(GRID[0] * 2**20)), out[1]["before"]  # the newcomer had not tuned
    assert out[0]["after"] == out[1]["after"], out  # rank 0's result, on both
    assert out[0]["after"]["done"] and out[0]["after"]["best"] == (GRID[-1], "flat"), out[0]["after"]
    assert out[0]["after"]["bucket_bytes"] == int(GRID[-1] * 2**20), out[0]["after"]
    for a, b in zip(out[0]["params"], out[1]["params"]):
        assert torch.equal(a, b)
