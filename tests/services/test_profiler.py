"""Timeline, step breakdown and scaling-report checks on real ranks.

One spawned group of 2 ranks trains a small MLP with hand-bucketed async
allreduce (the spans a data-parallel engine emits), with the timeline on.
"""

import collections
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import phalanx as px
from phalanx import trace
from phalanx.profiler import StepProfiler, breakdown, timeline
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

STEPS = 6


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _data(seed=1, n=STEPS * 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def _train(rank, size, slow_rank=None):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    per = len(x) // STEPS // size
    batches = [(x[s * per * size + rank * per:][:per], y[s * per * size + rank * per:][:per]) for s in range(STEPS)]
    prof = StepProfiler()
    loop_s = []
    for _step, (xb, yb) in prof.steps(batches):
        t0 = time.perf_counter()
        with prof.phase("forward"):
            loss = (model(xb) - yb).pow(2).mean()
        handles = []
        with prof.phase("backward"):
            loss.backward()
            if rank == slow_rank:
                time.sleep(0.03)  # a straggler
        for i, p in enumerate(reversed(list(model.parameters()))):
            start = time.perf_counter()
            # the launch blocks in the cross-rank mismatch check: collectives.py shows it as "negotiate"
            h = px.allreduce(p.grad, op=px.Average, inplace=True, async_op=True, name=f"b{i}")
            handles.append((i, p.grad.numel() * 4, start, h))
        with prof.phase("optimizer"):
            for i, nbytes, start, h in handles:
                with trace.span("wait", "comm", bucket=i):
                    h.wait()
                trace.instant("allreduce", "comm", start, time.perf_counter(), bucket=i, bytes=nbytes)
            opt.step()
            opt.zero_grad()
        loop_s.append(time.perf_counter() - t0)
    return model, loop_s


def _timeline_body(tmpdir):
    r, n = px.rank(), px.size()
    tl = timeline.start()
    assert timeline.start() is tl  # idempotent
    _model(), _data()  # warm up
    px.barrier()
    model, loop_s = _train(r, n, slow_rank=1)
    path = os.path.join(tmpdir, "trace.json")
    events = timeline.stop(path)
    bd = breakdown.from_events(events)
    if r == 0:
        bd.to_tensorboard(os.path.join(tmpdir, "tb"))
    off = trace.enabled()
    return {"params": [p.detach().clone() for p in model.parameters()], "bd": bd, "off_after": off,
            "events": len(events)}


def test_timeline_and_breakdown_on_two_ranks(tmp_path):
    results = distributed(_timeline_body, np=2, args=(str(tmp_path),))
    # instrumentation changes nothing: same parameters as single-process full-batch training
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _data()
    for xb, yb in zip(x.split(len(x) // STEPS), y.split(len(y) // STEPS)):
        (ref(xb) - yb).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for out in results:
        for p, q in zip(out["params"], ref.parameters()):
            torch.testing.assert_close(p, q.detach(), atol=1e-5, rtol=1e-5)
        assert out["off_after"] is False
    # the JSON loads and every rank has every kind of event
    events = timeline.load(tmp_path / "trace.json")
    assert len(events) == results[0]["events"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        names = {e["name"] for e in mine}
        assert {"step", "data", "forward", "backward", "optimizer", "wait", "allreduce", "negotiate"} <= names, names
        assert sum(e["name"] == "step" for e in mine) == STEPS
        assert all(e["dur"] >= 0 and e["ts"] > -1e6 for e in mine)
        buckets = {e["args"]["bucket"] for e in mine if e["name"] == "allreduce"}
        assert buckets == {0, 1, 2, 3}
    # common axis (causality): no allreduce ends on one rank before its peer launched it
    ars = {r: sorted((e for e in events if e["pid"] == r and e["name"] == "allreduce"), key=lambda e: e["ts"])
           for r in (0, 1)}
    for a, b in zip(ars[0], ars[1]):
        assert a["ts"] + a["dur"] > b["ts"] - 2000 and b["ts"] + b["dur"] > a["ts"] - 2000  # µs of skew
    # the breakdown adds up to the step time, and the spans cover it
    bd = results[0]["bd"]
    assert len(bd.steps) == 2 * STEPS
    for s in bd.steps:
        assert s.parts_s == pytest.approx(s.total_s, rel=1e-9)
        assert s.bytes_sent == sum(p.numel() * 4 for p in ref.parameters())
    for r in (0, 1):
        m = bd.mean(r)
        assert m["other_s"] < 0.05 * m["total_s"], bd.table()
        assert m["compute_s"] > 0 and m["comm_s"] + m["straggler_s"] > 0 and m["data_s"] > 0
    # rank 1 sleeps 30 ms in backward: in most steps rank 0 waits for it, rank 1 for nobody
    waits = [(a.straggler_s, b.straggler_s) for a, b in zip(bd.for_rank(0), bd.for_rank(1))]
    assert sum(w0 > w1 + 0.01 for w0, w1 in waits) > STEPS // 2, bd.table()
    assert "rank" in bd.table()
    # TensorBoard event files, one run per rank, one point per step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "rank0"))
    acc.Reload()
    assert len(acc.Scalars("step/comm_ms")) == STEPS


def test_breakdown_hand_made_spans():
    """Priority rules on a hand-made step: data > blocking comm > compute > async comm > other."""
    us = 1e6

    def x(name, cat, a, b, pid=0, **args):
        return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 0, "ts": a * us, "dur": (b - a) * us,
                "args": args}

    events = [
        x("step", "step", 0.0, 1.0, step=0),
        x("data", "data", 0.0, 0.1),
        x("forward", "compute", 0.1, 0.3),
        x("backward", "compute", 0.3, 0.6),
        x("allreduce", "comm", 0.4, 0.8, bytes=100),  # 0.4-0.6 hidden behind backward
        x("optimizer", "compute", 0.6, 0.95),
        x("wait", "comm", 0.6, 0.8),                  # blocking inside optimizer
        # rank 1 is ready 0.1 s later than rank 0
        x("step", "step", 0.0, 1.0, pid=1, step=0),
        x("backward", "compute", 0.0, 0.7, pid=1),
        x("wait", "comm", 0.7, 0.8, pid=1),
    ]
    bd = breakdown.from_events(events)
    r0, r1 = bd.for_rank(0)[0], bd.for_rank(1)[0]
    assert r0.data_s == pytest.approx(0.1)
    assert r0.compute_s == pytest.approx(0.2 + 0.3 + 0.15)
    assert r0.straggler_s == pytest.approx(0.1)
    assert r0.comm_s == pytest.approx(0.2 - 0.1)
    assert r0.other_s == pytest.approx(0.05)
    assert r0.bytes_sent == 100
    assert r1.straggler_s == 0 and r1.comm_s == pytest.approx(0.1) and r1.other_s == pytest.approx(0.2)

    # the optimizer stepped on decoded pieces inside the wait (overlap_optimizer) is compute, not comm
    overlap = breakdown.from_events([
        x("step", "step", 0.0, 1.0, step=0),
        x("backward", "compute", 0.0, 0.4),
        x("allreduce_wait", "comm", 0.4, 0.9),
        x("optimizer_piece", "compute", 0.5, 0.6, in_wait=True),
        x("optimizer_piece", "compute", 0.7, 0.8, in_wait=True),
    ]).for_rank(0)[0]
    assert overlap.compute_s == pytest.approx(0.6) and overlap.comm_s == pytest.approx(0.3)


def test_trace_is_free_when_off():
    assert not trace.enabled()
    assert trace.span("x", "compute") is trace.span("y", "comm")  # the shared no-op object


SCRIPT = """
import torch, phalanx as px
px.init()
model = px.DataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), compression="fp16")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    opt.zero_grad()
    model(torch.ones(4, 8) * px.rank()).sum().backward()
    opt.step()
"""


def test_phalanx_run_timeline_flag(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = tmp_path / "tl.json"
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", "--timeline", str(out),
                           sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    # A plain DataParallel script, no tracing code of its own: the library emits every span.
    for rank in (0, 1):
        count = collections.Counter(e["name"] for e in events if e["pid"] == rank and e["ph"] == "X")
        for name in ("forward", "backward", "optimizer", "compress", "allreduce_launch", "allreduce_wait",
                     "decompress"):
            assert count[name] == 3, (rank, name, count)
        assert count["negotiate"] >= 1, count  # the first iteration's cross-rank check, shown apart
    assert not list(tmp_path.glob("tl.json.rank*"))  # parts merged and removed


def test_scaling_report_and_timeline_png(tmp_path, monkeypatch):
    from phalanx.planner import cost
    from phalanx.profiler import report

    # speedups that follow Amdahl with P = 0.8 exactly: the fit recovers it
    rows = [report.ScalingRow(n, 100.0 * cost.amdahl(0.8, n), 1.0) for n in (1, 2, 4)]
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    out = report.write_report(rows, str(tmp_path / "rep"), note="a note")
    throughput, speedup = figures[0].axes
    for ax in (throughput, speedup):   # whole workers on the x axis, y from zero
        assert list(ax.get_xticks()) == [1, 2, 4]
        assert ax.get_ylim()[0] == 0
    assert "a note" in figures[0]._suptitle.get_text()
    assert out["amdahl_p"] == pytest.approx(0.8)
    assert out["efficiency"][4] == pytest.approx(cost.amdahl(0.8, 4) / 4)
    assert (tmp_path / "rep" / "scaling.png").stat().st_size > 1000
    assert "Amdahl fit" in (tmp_path / "rep" / "report.html").read_text()
    with pytest.raises(ValueError, match="1-worker"):
        report.summarise(rows[1:])
    events = [{"name": "forward", "cat": "compute", "ph": "X", "pid": r, "tid": 0, "ts": 10.0 * r, "dur": 500.0}
              for r in (0, 1)] + [{"name": "allreduce", "cat": "comm", "ph": "X", "pid": 0, "tid": 0,
                                   "ts": 300.0, "dur": 400.0}]
    png = report.render_timeline(events, str(tmp_path / "tl.png"))
    assert os.path.getsize(png) > 1000
