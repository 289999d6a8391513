"""Parameter server on real ranks: sync == data parallel, SSP bound, async convergence, failures.

One 4-rank group (2 servers, 2 workers) runs every mode; one 2-rank group checks failures.
"""

import re
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.checkpoint import CheckpointManager, read_manifest
from phalanx.demo import load_digits
from phalanx.ps import ParameterServer, PSError, PSTimeoutError, PSWorker, run_ps, shard_parameters
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

STEPS, BATCH = 8, 32


def _mlp(hidden=32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def _exact_train(worker):
    x, y, _, _ = load_digits()
    half = BATCH // worker.num_workers
    for step in range(STEPS):
        worker.pull()
        idx = slice(step * BATCH + worker.index * half, step * BATCH + (worker.index + 1) * half)
        worker.model.zero_grad()
        nn.functional.cross_entropy(worker.model(x[idx]), y[idx]).backward()
        worker.push()
    worker.pull()
    return [p.detach().clone() for p in worker.model.parameters()]


def _digits_train(worker, epochs=5, global_batch=64, slow_s=0.0):
    x, y, xt, yt = load_digits()
    local = global_batch // worker.num_workers
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for step in range(len(x) // global_batch):
            idx = order[step * global_batch + worker.index * local :][:local]
            worker.pull()
            if slow_s and worker.index == 0:
                time.sleep(slow_s)
            worker.model.zero_grad()
            nn.functional.cross_entropy(worker.model(x[idx]), y[idx]).backward()
            worker.push()
    worker.pull()
    with torch.no_grad():
        return (worker.model(xt).argmax(1) == yt).float().mean().item()


def _ssp_train(worker):
    return _digits_train(worker, epochs=1, slow_s=0.02)


def _adam(params):
    return torch.optim.Adam(params, lr=3e-3)


def _pull_only(worker):
    worker.pull()
    return [p.detach().clone() for p in worker.model.parameters()]


def _ps_suite(ckpt_dir):
    mgr = CheckpointManager(ckpt_dir, keep=1)
    out = {"exact": run_ps(_mlp, _sgd, _exact_train, num_servers=2, mode="sync", checkpoint=mgr)}
    # lossy int8 (error feedback on pushes, one residual per server link; plain codec on pulls)
    out["int8"] = run_ps(_mlp, _sgd, _exact_train, num_servers=2, mode="sync", compression="int8")
    # a second session resumes from the shards the first one saved (and has nothing new to save)
    out["resumed"] = run_ps(_mlp, _sgd, _pull_only, num_servers=2, mode="async", checkpoint=mgr)
    for mode, s, prefetch in (("ssp", 2, True), ("async", 0, False)):
        out[f"bound_{mode}"] = run_ps(_mlp, _sgd, _ssp_train, num_servers=2, mode=mode, staleness=s,
                                      prefetch=prefetch)
    model = lambda: _mlp(64)  # noqa: E731
    out["acc_sync"] = run_ps(model, _adam, _digits_train, num_servers=2, mode="sync")
    out["acc_async"] = run_ps(model, _adam, _digits_train, num_servers=2, mode="async", compression="fp16")
    out["acc_ssp"] = run_ps(model, _adam, _digits_train, num_servers=2, mode="ssp", staleness=1,
                            staleness_lr=True)
    return out


def _reference_params():
    model, (x, y, _, _) = _mlp(), load_digits()
    opt = _sgd(model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[step * BATCH : (step + 1) * BATCH]),
                                    y[step * BATCH : (step + 1) * BATCH]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_ps_modes_on_four_ranks(tmp_path):
    results = distributed(_ps_suite, np=4, args=(str(tmp_path),), timeout=240)
    servers, workers = results[:2], results[2:]
    assert [r["exact"]["role"] for r in results] == ["server", "server", "worker", "worker"]
    # 1. synchronous PS == synchronous data parallel on the global batch (one process)
    ref = _reference_params()
    for w in workers:
        for got, want in zip(w["exact"]["result"], ref):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # shards are balanced by size; each server saved its own through phalanx.checkpoint, and a new
    # session resumed from them: its workers pull exactly the trained parameters
    names = shard_parameters({n: p.numel() for n, p in _mlp().named_parameters()}, 2)
    assert sorted(sum(names, [])) == sorted(n for n, _ in _mlp().named_parameters())
    manifest = read_manifest(str(tmp_path / f"step-{STEPS:09d}"))
    assert manifest["world_size"] == 4 and manifest["meta"] == {"step": STEPS}
    for w in workers:
        for got, want in zip(w["resumed"]["result"], ref):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert [s["resumed"]["stats"]["version"] for s in servers] == [STEPS, STEPS]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{STEPS:09d}"]
    assert all(s["exact"]["stats"]["staleness"] == {0: STEPS * 2} for s in servers)
    # int8 pushes and pulls: about 4x fewer bytes, parameters still close to exact sync SGD
    w8, w32 = workers[0]["int8"], workers[0]["exact"]
    assert w8["stats"]["push_bytes"] < 0.35 * w32["stats"]["push_bytes"], (w8["stats"], w32["stats"])
    assert w8["stats"]["pull_bytes"] < 0.35 * w32["stats"]["pull_bytes"]
    for got, want in zip(w8["result"], ref):
        assert 0 < (got - want).abs().max() < 0.02
    # 2. SSP: no pull granted more than s=2 clocks ahead of the slowest; the bound is reached
    # (the slow worker makes it bind), while async with the same straggler drifts further.
    for s in servers:
        ssp = s["bound_ssp"]["stats"]
        assert ssp["max_gap"] == 2, ssp["clock_gap"]
        assert max(ssp["clock_gap"]) <= 2 and ssp["held_pulls"] > 0
        assert s["bound_async"]["stats"]["max_gap"] > 2
    # 3. async (fp16 pushes/pulls) and SSP converge to within 2 points of sync
    acc = {m: workers[0][f"acc_{m}"]["result"] for m in ("sync", "async", "ssp")}
    assert acc["sync"] > 0.9, acc
    assert acc["async"] >= acc["sync"] - 0.02 and acc["ssp"] >= acc["sync"] - 0.02, acc
    # 4. statistics: fp16 halves the bytes per push; servers saw every push
    per_step = {m: workers[0][f"acc_{m}"]["stats"]["push_bytes"] / workers[0][f"acc_{m}"]["stats"]["steps"]
                for m in ("sync", "async")}
    assert 0.45 < per_step["async"] / per_step["sync"] < 0.6, per_step
    steps = sum(w["acc_sync"]["stats"]["steps"] for w in workers)
    assert all(s["acc_sync"]["stats"]["pushes"] == steps for s in servers)
    # 5. replies a worker has read are freed (gloo marks a send complete only once waited on):
    # over a whole run each server keeps at most two replies per worker alive, not one per pull
    for s in servers:
        for run in ("acc_sync", "acc_async", "acc_ssp", "bound_async"):
            assert 1 <= s[run]["stats"]["max_in_flight"] <= 2, (run, s[run]["stats"]["max_in_flight"])


def _silent_then_dead(flag_dir):
    out = {}
    try:
        run_ps(_mlp, _sgd, _exact_train, num_servers=2)
    except ValueError as err:
        out["bad_servers"] = str(err)
    if px.rank() == 0:  # 1. waits for a worker that never speaks: must raise, naming it
        with pytest.raises(PSTimeoutError) as err:
            ParameterServer(_mlp(), _sgd, servers=[0], workers=[1], timeout_s=1.5).serve()
        out["silent_worker"] = str(err.value)
        (flag_dir / "gave_up").touch()  # (a timed-out gloo pair is closed: no barrier after it)
        return out  # 2. the server leaves without serving
    deadline = time.monotonic() + 50
    while not (flag_dir / "gave_up").exists():  # silent until the server has given up on us
        assert time.monotonic() < deadline, "rank 0 never timed out"
        time.sleep(0.05)
    with pytest.raises(PSError) as err:
        PSWorker(_mlp(), servers=[0], workers=[1], timeout_s=3).pull()
    out["dead_server"] = str(err.value)
    return out


def test_dead_or_silent_peer_is_reported(tmp_path):
    server, worker = distributed(_silent_then_dead, np=2, args=(tmp_path,), timeout=60)
    assert "num_servers=2" in server["bad_servers"]
    assert re.search(r"server rank 0 waiting for workers \[1\].*no answer within 1.5s", server["silent_worker"])
    assert "worker rank 1" in worker["dead_server"] and "server rank 0" in worker["dead_server"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_servers"):
        shard_parameters({"w": 1}, 0)
    assert shard_parameters({"w": 100, "b": 10, "v": 90}, 2) == [["w"], ["b", "v"]]


_CLI_SCRIPT = """
import torch, phalanx as px
from torch import nn
from phalanx.ps import run_ps

def model():
    torch.manual_seed(0)
    return nn.Linear(4, 2)

def train(worker):
    for _ in range(3):
        worker.pull()
        worker.model.zero_grad()
        worker.model(torch.ones(1, 4)).sum().backward()
        worker.push()
    worker.pull()
    return round(worker.model.bias.sum().item(), 6)

px.init()
out = run_ps(model, lambda ps: torch.optim.SGD(ps, lr=0.5), train, mode="sync")
print("ROLE", out["role"], out["stats"].get("pushes"), out["result"])
from phalanx.runtime.jobkey import job_key
print("SIGNED", job_key() is not None)  # phalanx run made a job secret: the frames were signed with it
px.shutdown()
"""


def test_phalanx_run_servers_flag(tmp_path):
    script = tmp_path / "ps_job.py"
    script.write_text(_CLI_SCRIPT)
    cli = [sys.executable, "-m", "phalanx", "run"]
    proc = subprocess.run(cli + ["-np", "3", "--servers", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    roles = sorted(line.split("ROLE ", 1)[1] for line in proc.stdout.splitlines() if "ROLE " in line)
    # two servers (the weight and the bias go to different ones), each saw the worker's 3 pushes;
    # the worker's bias after 3 sync steps of lr 0.5 on d(sum)/d(bias) = 1: 0 + 2 * (-1.5)
    torch.manual_seed(0)
    bias = round(nn.Linear(4, 2).bias.sum().item() - 3.0, 6)
    assert roles == ["server 3 None", "server 3 None", f"worker None {bias}"], proc.stdout
    assert proc.stdout.count("SIGNED True") == 3, proc.stdout
    proc = subprocess.run(cli + ["-np", "2", "--servers", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--servers 2 must be between 1 and -np minus 1 (1)" in proc.stderr
