"""Pipeline benchmark: bubble vs the formula (and where the excess goes), phalanx 1F1B vs
torch.distributed.pipelining, and the cost-balanced split vs the uniform one — all in one run on
p = 2 CPU ranks (gloo, 1 thread each).

Run:  python benchmarks/pipeline.py [--width 256] [--hidden 1024] [--blocks 16] [--micro-rows 128]
                                    [--repeats 10] [--stages 2] [--sections bubble,throughput,split]
      (benchmarks/LOG.md rows: under `flock /tmp/phalanx-bench.lock …` on the shared 2-core box)

Why 128 rows per micro-batch by default. On this box (gloo over loopback TCP) a send costs the
SENDING rank's CPU before the call returns (the write and the receive path's softirq run on the
sender), and the cost is mostly per call, not per byte: `--sections exchange` measured a send
call as a stage makes it at 0.13 ms mean for 64 KB, 0.18-0.19 ms for 128 KB and 0.10-0.16 ms for
1 KB; timed inside the pipeline (an instrumented copy of the stage) 0.19-0.22 ms per 64 KB send,
0.22-0.28 ms per 128 KB send. With 64 rows a stage's forward + backward of one micro-batch is
~21 ms; at m = 8 its 8 sends plus ~0.1 ms of other per-action Python are ~2.6 ms of a ~210 ms
step, ~1.2 % of the step = ~11 % of the formula's bubble (0.111) by themselves, so the benchmark
measured loopback TCP more than the schedule. 64 rows of width 256 is also smaller than any real
pipeline's micro-batch. At 128 rows compute doubles (~39 ms) and the sends barely grow.
`--micro-rows 64` still runs the small case.

The bubble/throughput model is shaped like a real one, so that its stages can be equal: a cheap
input projection Linear(64, 256), 16 identical heavy blocks (a transformer's residual feed-forward
x + W2 relu(W1 x), hidden 1024), a cheap head Linear(256, 64) and the MSE loss. Every heavy block
then computes its input's gradient (the first is fed by the input projection), and the 18 blocks
split finely enough for the cost-balanced partitioner to equalize the stages ((0, 9, 18) at p = 2).

1. Bubble, m = 1, 2, 4, 8: phalanx GPipe (the formula's own schedule), 1F1B and eager
   1F1B (one more warm-up forward). Every stage keeps the start and end of each
   forward and backward (``PipelineStage.last_timeline``; one host, so the
   perf_counter clocks are the same clock). Per step:

     span      first compute start on any stage -> last compute end on any stage
     measured  1 - mean(stage busy time) / span                    (the formula's definition)
     replay    the same, with each action's measured duration replayed through the
               schedule's dependencies with zero communication time
               (phalanx.parallel.pipeline.replay): the bubble these exact compute
               times would give on a perfect network. replay - formula is what unequal
               or noisy compute costs (a stage slowed by another process makes its
               neighbour wait); measured - replay is what the transfers and the
               wake-ups of waiting ranks cost.

     bound     phalanx.parallel.pipeline.bubble_bound: the formula generalised to these
               stages, each stage's median forward and backward replayed with zero
               communication. (p-1)/(v·m+p-1) assumes every stage costs the same.

   The stages are cut by the cost-balanced partitioner (measured time, the loss counted
   on the last block, the first block without input gradient, as in the pipeline; each
   block's time the median of 3 rounds of ``block_costs``, robust to a burst of load); its
   per-stage costs are printed, and each stage's median forward / backward in the pipeline
   next to each bubble. "1f1b/ahead1" is the same 1F1B with ``recv_ahead=1`` (each receive
   posted one action ahead, between two computes: the executor before it posted the step's
   receives while idle). Interleaved 1F1B (v = 2 chunks per rank, the 18 blocks cut into 2p
   cost-balanced pieces) is measured the same way.
2. Throughput at m = 8 on the same stages (same weights): phalanx 1F1B vs
   torch.distributed.pipelining.Schedule1F1B (and phalanx interleaved 1F1B), repeats
   interleaved, medians.
3. A model of 8 x Linear(1024)+ReLU blocks, the first 6x heavier: the min-bottleneck split
   on measured time and on FLOPs vs the uniform split, phalanx 1F1B step time, interleaved.
4. ``fixed``: the formula's assumption made exact. Every stage's body costs a fixed F and B
   (``--fixed-ms 15,30``, about the real stages' at 128 rows) of busy CPU on L1-resident data,
   whatever the machine's neighbours do to compute speed, and the real model's activations are
   sent. On this VM the real stages' forward and backward move by 10-50 % from minute to minute
   (the replay with zero transfer time in section 1 is itself off the formula by that much), so
   this is where the schedule and its transport are measured against the formula: phalanx GPipe,
   1F1B, eager 1F1B (and the last two with gradients sharing the activations' process group,
   ``grad_group=None``), then torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B on the
   same stages, interleaved; timeline bubble (phalanx) and step-time bubble (both libraries).
5. ``noise``: the same stage's forward + backward of 8 micro-batches in one process with no
   communication, 20 times: how far this machine's compute moves from step to step.
"""

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import phalanx as px
from phalanx.parallel.pipeline import (
    Partition,
    PipelineStage,
    bubble_bound,
    bubble_fraction,
    get_schedule,
    min_bottleneck_split,
    partition,
    replay,
)

MS = (1, 2, 4, 8)


def _cases(p):  # interleaved: 2 chunks, m a multiple of p; "/ahead1": receives posted one action ahead only
    return ([("gpipe", m) for m in MS] + [("1f1b", m) for m in MS] + [("eager_1f1b", m) for m in MS]
            + [("1f1b/ahead1", m) for m in MS]
            + [("interleaved_1f1b", m) for m in (2, 4, 8) if m % p == 0])


class FeedForward(nn.Module):
    """A transformer's feed-forward block: ``x + W2 relu(W1 x)`` (hidden = 4 x width)."""

    def __init__(self, width, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _model(width, hidden, n, io):
    """The bubble/throughput model, shaped like a real one: a cheap input projection (io -> width),
    n identical heavy blocks, a cheap head (width -> io); the loss on the head's output."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(io, width), *[FeedForward(width, hidden) for _ in range(n)], nn.Linear(width, io))


def _blocks(width, n, heavy=0):
    torch.manual_seed(0)
    blocks = []
    for i in range(n):
        depth = heavy if (heavy and i == 0) else 1
        blocks.append(nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]))
    return nn.Sequential(*blocks)


class _Spin(torch.autograd.Function):
    """Identity whose forward costs exactly ``fwd_s`` and backward ``bwd_s`` seconds of busy CPU."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        _busy(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _busy(ctx.bwd_s)
        return grad.clone(), None, None


_SPIN = torch.ones(32, 32)


def _busy(seconds):
    """Real work (32 x 32 matmuls, resident in L1: no memory traffic to share with the other rank)
    until ``seconds`` of wall time have passed: a compute of fixed duration, whatever the machine's
    neighbours do to its speed."""
    end, out = time.perf_counter() + seconds, torch.empty(32, 32)
    while time.perf_counter() < end:
        torch.mm(_SPIN, _SPIN, out=out)


class FixedCost(nn.Module):
    """A stage body of fixed cost: forward ``fwd_ms``, backward ``bwd_ms`` (the formula's assumption,
    made exact), with a learnable scale so that the stage has a parameter and a gradient."""

    def __init__(self, fwd_ms, bwd_ms):
        super().__init__()
        self.fwd_s, self.bwd_s = fwd_ms / 1e3, bwd_ms / 1e3
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Spin.apply(x, self.fwd_s, self.bwd_s) * self.scale


def _loss(out, y):
    return (out - y).pow(2).mean()


def _timed(fn):
    px.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _bubble_parts(timelines, chunks=1):
    """(measured, replay) bubble of one step from every stage's compute timeline (module docstring)."""
    span = max(t[-1].end_s for t in timelines) - min(t[0].start_s for t in timelines)
    busy = statistics.mean(sum(a.end_s - a.start_s for a in t) for t in timelines)
    acts = [[(a.kind, a.mb, a.chunk) for a in t] for t in timelines]
    ideal = replay(acts, chunks, duration=lambda s, k: timelines[s][k].end_s - timelines[s][k].start_s)
    ideal_span = max(t[-1][4] for t in ideal)
    return 1.0 - busy / span, 1.0 - busy / ideal_span


def _exchange(cfg, n=300):
    """What one hop costs here: each rank posts a receive, computes ~1 ms, sends one activation-sized
    message (or 1 KB) to the other and waits for the other's. Per message size, the wait's
    percentiles (ms), and the delay once both sides were ready: from the later of the peer's send
    (its CLOCK_MONOTONIC time rides in the message; one machine, one clock) and this rank's wait
    start, to the message in hand. The wait includes the peer's compute running late; the delay
    is the transfer alone. Then :func:`_send_cost`."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    pg, peer = dist.group.WORLD, 1 - px.rank()
    w, a = torch.randn(cfg["width"], cfg["hidden"]), torch.randn(cfg["micro_rows"], cfg["width"])
    res = {}
    for numel in (cfg["micro_rows"] * cfg["width"], 256):
        t, buf, waits, late = torch.randn(numel), torch.empty(numel), [], []
        for _ in range(n):
            px.barrier()
            rw = pg.recv([buf], peer, 0)
            for _ in range(10):
                (a @ w).relu_()
            t.view(torch.float64)[0] = time.monotonic()
            sw = pg.send([t], peer, 0)
            t0 = time.perf_counter()
            ready = time.monotonic()
            rw.wait()
            waits.append(time.perf_counter() - t0)
            late.append(time.monotonic() - max(ready, float(buf.view(torch.float64)[0])))
            sw.wait()
        res[numel * 4] = [sorted(v)[int(q * (n - 1))] * 1e3 for v in (waits, late) for q in (0.5, 0.9, 0.99, 1.0)]
    res["send"] = _send_cost(pg, peer, a, w, n)
    return res


def _send_cost(pg, peer, a, w, n):
    """The CPU a send costs its sender, as a pipeline stage sends: the sender computes ~1 ms and
    sends one message while the receiver, its receive posted, computes ~1 ms (its own action) and
    then waits. The ranks take turns sending. On loopback TCP gloo writes the message, and the
    kernel runs the receive path, on the sender's CPU before the send call returns: that time is
    lost to the sending stage's compute. Per message size: the send call's p50, p90, mean (ms)."""
    out = {}
    for numel in (a.numel(), 256):
        t, buf, took = torch.randn(numel), torch.empty(numel), []
        for k in range(2 * n):
            sender = k % 2
            px.barrier()
            rw = pg.recv([buf], peer, 1) if px.rank() != sender else None
            for _ in range(10):
                (a @ w).relu_()
            if rw is None:
                t0 = time.perf_counter()
                sw = pg.send([t], peer, 1)
                took.append(time.perf_counter() - t0)
                sw.wait()
            else:
                rw.wait()
        took.sort()
        out[numel * 4] = [took[len(took) // 2] * 1e3, took[int(0.9 * (len(took) - 1))] * 1e3,
                          statistics.mean(took) * 1e3]
    return out


FIXED = ("gpipe", "1f1b", "eager_1f1b", "1f1b/one group", "eager_1f1b/one group", "torch ScheduleGPipe",
         "torch Schedule1F1B")  # "/one group": gradients share the activations' process group (grad_group)


def _fixed(P, cfg, repeats):
    """Section 4: the formula's own assumption made exact. Every stage's body is :class:`FixedCost`
    (forward F, backward B of busy CPU whatever the machine does to compute speed; stage 0 adds the
    cheap input Linear, the last stage the cheap head and the loss), the activations the real model's
    (micro_rows x width float32, sent for real). What remains between the measured bubble and the
    formula is the schedule and its transport: transfers, posting, wake-ups, Python. The same stages
    under torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B, interleaved with ours. Returns
    {(schedule, m): [step seconds]} and {(phalanx schedule, m): [timelines]}."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    r, last, rows = px.rank(), px.rank() == P - 1, cfg["micro_rows"]
    torch.manual_seed(0)
    body = nn.Sequential(*([nn.Linear(cfg["io"], cfg["width"])] if r == 0 else []), FixedCost(*cfg["fixed_ms"]),
                         *([nn.Linear(cfg["width"], cfg["io"])] if last else []))
    ours = PipelineStage(body, r, P, loss_fn=_loss if last else None)
    shared = PipelineStage(body, r, P, loss_fn=_loss if last else None, grad_group=None)
    theirs_mod = copy.deepcopy(body)
    theirs = TorchStage(theirs_mod, r, P, torch.device("cpu"), group=dist.group.WORLD)
    g = torch.Generator().manual_seed(1)
    data = {m: (torch.randn(m * rows, cfg["io"], generator=g), torch.randn(m * rows, cfg["io"], generator=g))
            for m in MS}
    torch_sched = {("torch ScheduleGPipe", m): ScheduleGPipe(theirs, m, loss_fn=_loss) for m in MS}
    torch_sched.update({("torch Schedule1F1B", m): Schedule1F1B(theirs, m, loss_fn=_loss) for m in MS if m >= P})

    def step(name, m):
        x, y = data[m]
        if name.startswith("torch"):
            sched = torch_sched[(name, m)]
            sched.step(x) if r == 0 else (sched.step(target=y, losses=[]) if last else sched.step())
            theirs_mod.zero_grad()
        else:
            (shared if name.endswith("/one group") else ours).step(x, y, num_microbatches=m,
                                                                    schedule=name.split("/")[0])
            body.zero_grad()

    times, lines = {}, {}
    for rep in range(repeats + 1):
        for name in FIXED:
            for m in MS:
                if name.startswith("torch") and (name, m) not in torch_sched:
                    continue
                t = _timed(lambda name=name, m=m: step(name, m))
                if rep:  # the first round is a warm-up
                    times.setdefault((name, m), []).append(t)
                    if not name.startswith("torch"):
                        stage = shared if name.endswith("/one group") else ours
                        lines.setdefault((name, m), []).append(stage.last_timeline)
    return times, lines


def _compute_noise(cfg, steps=20):
    """Section 5: how steady this machine's compute is, with no pipeline and no communication. One
    process, one thread, times the last real stage's forward + backward of m = 8 micro-batches
    ``steps`` times. The formula assumes every stage costs the same every time; at m = 8 its bubble
    is 11 % of the step, so a 1 % change in a stage's compute moves the measured bubble by ~9 % of
    the formula. Returns each step's seconds."""
    torch.set_num_threads(1)
    model = _model(cfg["width"], cfg["hidden"], cfg["blocks"], cfg["io"])
    stage = nn.Sequential(*list(model.children())[len(model) // 2 :])
    xs = [torch.randn(cfg["micro_rows"], cfg["width"], requires_grad=True) for _ in range(8)]
    y = torch.randn(cfg["micro_rows"], cfg["io"])
    took = []
    for k in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        for x in xs:
            _loss(stage(x), y).backward()
        if k >= 2:
            took.append(time.perf_counter() - t0)
    return took


def _rank_body(P, cfg, sections):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B

    torch.set_num_threads(1)
    r = px.rank()
    last = r == P - 1
    micro_rows, repeats = cfg["micro_rows"], cfg["repeats"]
    model = _model(cfg["width"], cfg["hidden"], cfg["blocks"], cfg["io"])

    def batch(m):
        g = torch.Generator().manual_seed(m)
        return (torch.randn(m * micro_rows, cfg["io"], generator=g),
                torch.randn(m * micro_rows, cfg["io"], generator=g))

    # The cost-balanced split (measured time, loss on the last block); rank 0 measures alone and decides,
    # for p stages (1F1B) and for 2p pieces (interleaved, rank r runs pieces r and r + p). Each block's
    # time is its median over 3 rounds of timing (partition's default ``rounds=3``): blocks are timed one
    # after another, so a burst of load during a single round skews a contiguous run of blocks and with
    # it the split (one run at 128 rows cut (0, 8, 18) from a single round: stages 20 % apart).
    plan = None
    if r == 0:
        sample, target = batch(1)
        plan = partition(model, P, method="time", sample=sample, loss_fn=_loss, target=target)
        plan = (plan.bounds, plan.stage_costs, min_bottleneck_split(plan.block_costs, 2 * P), plan.block_costs)
    bounds, costs, bounds2, block_cost = px.broadcast_object(plan, root_rank=0)
    stage_mod = nn.Sequential(*list(model.children())[bounds[r] : bounds[r + 1]])
    px_stage = PipelineStage(stage_mod, r, P, loss_fn=_loss if last else None)
    chunks = Partition(bounds2, block_cost).split(model)[r::P]
    stages = {"gpipe": px_stage, "1f1b": px_stage, "eager_1f1b": px_stage, "interleaved_1f1b": PipelineStage(chunks, r, P, loss_fn=_loss if last else None),
              "1f1b/ahead1": PipelineStage(stage_mod, r, P, loss_fn=_loss if last else None, recv_ahead=1)}
    out = {"timelines": {}, "px": [], "torch": [], "eager": [], "interleaved": [], "uniform": [], "time": [], "flops": [],
           "plan": (bounds, costs, bounds2)}

    # 1. bubble: keep each step's compute timeline; the parent lines the stages up
    batches = {m: batch(m) for m in MS}
    for rep in range(repeats + 1 if "bubble" in sections else 0):
        for name, m in _cases(P):  # interleaved, so a burst of load on the machine hits every case alike
            x, y = batches[m]
            px.barrier()
            stages[name].step(x, y, num_microbatches=m, schedule=name.split("/")[0])
            model.zero_grad()
            if rep:  # the first round is a warm-up
                out["timelines"].setdefault((name, m), []).append(stages[name].last_timeline)

    if "fixed" in sections:
        out["fixed"] = _fixed(P, cfg, repeats)
    if "exchange" in sections and P == 2:
        out["exchange"] = _exchange(cfg)

    # 2. phalanx vs torch.distributed.pipelining on the same stage weights
    m = 8
    x, y = batches[m]
    torch_mod = copy.deepcopy(stage_mod)
    t_stage = TorchStage(torch_mod, r, P, torch.device("cpu"), group=dist.group.WORLD)
    t_sched = Schedule1F1B(t_stage, m, loss_fn=_loss)

    def torch_step():
        if r == 0:
            t_sched.step(x)
        else:
            t_sched.step(target=y, losses=[])
        torch_mod.zero_grad()

    def px_step():
        px_stage.step(x, y, num_microbatches=m, schedule="1f1b")
        stage_mod.zero_grad()

    def eager_step():
        px_stage.step(x, y, num_microbatches=m, schedule="eager_1f1b")
        stage_mod.zero_grad()

    def interleaved_step():
        stages["interleaved_1f1b"].step(x, y, num_microbatches=m, schedule="interleaved_1f1b")
        model.zero_grad()

    if "throughput" in sections:
        torch_step()
        px_step()
        eager_step()
        interleaved_step()
    for _ in range(repeats if "throughput" in sections else 0):
        out["px"].append(_timed(px_step))
        out["torch"].append(_timed(torch_step))
        out["eager"].append(_timed(eager_step))
        out["interleaved"].append(_timed(interleaved_step))

    # 3. one heavy block: measured-time and FLOP-count splits vs the uniform split
    if "split" not in sections:
        return out
    heavy = _blocks(cfg["split_width"], 8, heavy=6)
    sample = torch.randn(micro_rows, cfg["split_width"])
    x, y = torch.randn(m * micro_rows, cfg["split_width"]), torch.randn(m * micro_rows, cfg["split_width"])
    splits = {}
    for method in ("uniform", "time", "flops"):
        bounds = px.broadcast_object(partition(heavy, P, method=method, sample=sample).bounds, root_rank=0)
        mod = nn.Sequential(*list(heavy.children())[bounds[r] : bounds[r + 1]])
        splits[method] = (bounds, PipelineStage(mod, r, P, loss_fn=_loss if last else None), mod)
    out["bounds"] = {k: v[0] for k, v in splits.items()}

    def heavy_step(method):
        _, st, mod = splits[method]
        st.step(x, y, num_microbatches=m, schedule="1f1b")
        mod.zero_grad()

    for method in splits:
        heavy_step(method)
    for _ in range(repeats):
        for method in splits:
            out[method].append(_timed(lambda method=method: heavy_step(method)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256, help="the heavy blocks' width (bubble, throughput)")
    ap.add_argument("--hidden", type=int, default=1024, help="the heavy blocks' hidden width")
    ap.add_argument("--blocks", type=int, default=16, help="number of heavy blocks")
    ap.add_argument("--io-width", type=int, default=64, help="model input and output width (cheap ends)")
    ap.add_argument("--split-width", type=int, default=1024, help="Linear width of the one-heavy-block model")
    ap.add_argument("--micro-rows", type=int, default=128,
                    help="rows per micro-batch (128: see the module docstring for why not 64)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--stages", type=int, default=2, help="p (ranks); > 2 oversubscribes a 2-core machine")
    ap.add_argument("--fixed-ms", default="15,30",
                    help="fixed section: each stage's forward,backward in ms (the real stages' are ~15,30 at 128 rows)")
    ap.add_argument("--sections", default="bubble,throughput,split,fixed,noise",
                    help="comma-separated subset to run (also: exchange, p = 2 only: one hop's wait percentiles)")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    P = a.stages
    cfg = {"width": a.width, "hidden": a.hidden, "blocks": a.blocks, "io": a.io_width, "micro_rows": a.micro_rows,
           "repeats": a.repeats, "split_width": a.split_width,
           "fixed_ms": tuple(float(v) for v in a.fixed_ms.split(","))}
    res = px.run(_rank_body, np=P, args=(P, cfg, sections), timeout=1800)

    bounds, costs, bounds2 = res[0]["plan"]
    print(f"p={P} stages; model Linear({a.io_width},{a.width}), {a.blocks} x FeedForward({a.width}, hidden "
          f"{a.hidden}, residual), head Linear({a.width},{a.io_width}), MSE loss; {a.micro_rows} rows per "
          f"micro-batch, {a.repeats} repeats (median)")
    print(f"1F1B stages: cost-balanced split {bounds} (measured time, loss on the last block); partitioner's "
          f"stage costs (forward+backward of one micro-batch, run alone) "
          f"{' / '.join(f'{c * 1e3:.1f}' for c in costs)} ms (per block: median of 3 rounds); interleaved pieces "
          f"{bounds2}\n")
    if "bubble" in sections:
        print("| schedule | m | formula (p-1)/(v·m+p-1) | measured bubble | measured / formula "
              "| replay (zero comm) | bound for these stages | measured / bound | median F / B per stage (ms) |")
        print("|---|---|---|---|---|---|---|---|---|")
    for name, m in _cases(P) if "bubble" in sections else ():
        v = 2 if name.startswith("interleaved") else 1
        parts = [_bubble_parts([res[s]["timelines"][(name, m)][i] for s in range(P)], v) for i in range(a.repeats)]
        measured, ideal = (statistics.median(p[k] for p in parts) for k in range(2))
        formula = bubble_fraction(P, m, v)
        fb = []
        for s in range(P):
            spans = [act for t in res[s]["timelines"][(name, m)] for act in t]
            # a stage's whole forward (backward) of one micro-batch: its v chunk actions' medians summed
            fb.append(tuple(sum(statistics.median(act.end_s - act.start_s for act in spans
                                                  if act.kind == k and act.chunk == c) for c in range(v))
                            for k in "FB"))
        bound = bubble_bound(fb, m, name.split("/")[0])
        print(f"| {name} | {m} | {formula:.3f} | {measured:.3f} | {measured / formula:.2f} | {ideal:.3f} "
              f"| {bound:.3f} | {measured / bound:.2f} | {' '.join(f'{f * 1e3:.1f}/{b * 1e3:.1f}' for f, b in fb)} |")

    def med(key):  # a step ends when its slowest rank ends
        return statistics.median(max(r[key][i] for r in res) for i in range(a.repeats))

    if "exchange" in sections and P == 2:
        print("\n| one hop: both ranks compute ~1 ms, then exchange | wait p50 | p90 | p99 | max (ms) "
              "| delay once both ready p50 | p90 | p99 | max (ms) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in res:
            for nbytes, q in r["exchange"].items():
                if nbytes != "send":
                    print(f"| rank {res.index(r)}, {nbytes:,} bytes | " + " | ".join(f"{v:.2f}" for v in q) + " |")
        print("\n| one send, as a stage sends (the peer computes, its receive posted) | send call p50 | p90 "
              "| mean (ms) | mean x 8 (ms, one stage's sends per step at m = 8) |\n|---|---|---|---|---|")
        for r in res:
            for nbytes, q in r["exchange"]["send"].items():
                print(f"| rank {res.index(r)} sends {nbytes:,} bytes | " + " | ".join(f"{v:.2f}" for v in q)
                      + f" | {q[2] * 8:.2f} |")
    if "fixed" in sections:
        _print_fixed(res, P, cfg["fixed_ms"], a.repeats)
    if "noise" in sections:
        took = sorted(_compute_noise(cfg))
        mid = statistics.median(took)
        print(f"\nCompute noise (section 5; one process, no communication): the last stage's forward + backward "
              f"of 8 micro-batches, {len(took)} times: median {mid * 1e3:.1f} ms, min {took[0] * 1e3:.1f}, "
              f"max {took[-1] * 1e3:.1f}; p10-p90 {(took[len(took) // 10] / mid - 1) * 100:+.1f} % / "
              f"{(took[len(took) * 9 // 10] / mid - 1) * 100:+.1f} % of the median = "
              f"{(took[len(took) * 9 // 10] - took[len(took) // 10]) / mid / bubble_fraction(2, 8) * 100:.0f} % "
              "of the m = 8 formula bubble (p = 2)")
    if "throughput" in sections:
        _print_throughput(med, a.micro_rows)
    if "split" in sections:
        _print_split(med, res[0]["bounds"], P)


def _print_fixed(res, P, fixed_ms, repeats):
    f_ms, b_ms = fixed_ms
    # A stage's real cost per micro-batch: the spin plus its Linear, loss and autograd bookkeeping, the same
    # work under either library: the median forward + backward in phalanx's timelines, mean over the stages.
    fb = statistics.mean(statistics.median(a.end_s - a.start_s for k in res[s]["fixed"][1] for t in res[s]["fixed"][1][k]
                                           for a in t if a.kind == kind) for s in range(P) for kind in "FB") * 2
    print(f"\nFixed-cost stages (section 4): every stage's forward {f_ms:g} ms, backward {b_ms:g} ms of busy CPU "
          f"(with its Linear, loss and autograd: F+B = {fb * 1e3:.1f} ms), real activations sent; step bubble = "
          "1 - m(F+B) / step time (the slowest rank's, barrier to return: the schedule's setup and the barrier's "
          "skew count too), median; timeline bubble and its replay with zero transfer time (the schedule alone) "
          "as in section 1 (phalanx only)\n")
    print("| schedule | m | formula | step (ms) | ideal (m+p-1)(F+B) | step bubble | / formula "
          "| timeline bubble | / formula | replay (zero comm) | / formula |\n|---|---|---|---|---|---|---|---|---|---|---|")
    steps = {}
    for name in FIXED:
        for m in MS:
            if (name, m) not in res[0]["fixed"][0]:
                continue
            t = statistics.median(max(r["fixed"][0][(name, m)][i] for r in res) for i in range(repeats))
            steps[(name, m)] = t
            formula, bubble = bubble_fraction(P, m), 1 - m * fb / t
            line = (f"| {name} | {m} | {formula:.3f} | {t * 1e3:.1f} | {(m + P - 1) * fb * 1e3:.0f} "
                    f"| {bubble:.3f} | {bubble / formula:.2f} |")
            if name.startswith("torch"):
                print(line + " - | - | - | - |")
                continue
            parts = [_bubble_parts([r["fixed"][1][(name, m)][i] for r in res]) for i in range(repeats)]
            tl, ideal = (statistics.median(p[k] for p in parts) for k in range(2))
            print(line + f" {tl:.3f} | {tl / formula:.2f} | {ideal:.3f} | {ideal / formula:.2f} |")
    pairs = [("gpipe", "torch ScheduleGPipe"), ("1f1b", "torch Schedule1F1B"), ("eager_1f1b", "torch Schedule1F1B")]
    print("\nphalanx / torch throughput on fixed-cost stages: " + "; ".join(
        f"{ours} vs {theirs}: " + ", ".join(f"m={m} {steps[(theirs, m)] / steps[(ours, m)]:.2f}x"
                                            for m in MS if (theirs, m) in steps) for ours, theirs in pairs))


def _print_throughput(med, micro_rows):
    px_s, torch_s, il_s, eager_s = med("px"), med("torch"), med("interleaved"), med("eager")
    rows = 8 * micro_rows
    print("\n| m=8 | step (ms) | samples/s |")
    print("|---|---|---|")
    print(f"| phalanx 1F1B | {px_s * 1e3:.1f} | {rows / px_s:,.0f} |")
    print(f"| torch.distributed.pipelining Schedule1F1B | {torch_s * 1e3:.1f} | {rows / torch_s:,.0f} |")
    print(f"| phalanx interleaved 1F1B, 2 chunks | {il_s * 1e3:.1f} | {rows / il_s:,.0f} |")
    print(f"| phalanx eager 1F1B | {eager_s * 1e3:.1f} | {rows / eager_s:,.0f} |")
    print(f"\nphalanx / torch throughput ratio (1F1B): {torch_s / px_s:.2f}x, (eager 1F1B): {torch_s / eager_s:.2f}x; "
          f"interleaved / 1F1B: {px_s / il_s:.2f}x")


def _print_split(med, b, P):
    m = 8
    uni = med("uniform")
    print("\n| heavy first block, m=8 | bounds | step (ms) | speedup vs uniform |\n|---|---|---|---|")
    print(f"| uniform split | {b['uniform']} | {uni * 1e3:.1f} | 1.00x |")
    for method in ("time", "flops"):
        t = med(method)
        print(f"| min-bottleneck split on {method} | {b[method]} | {t * 1e3:.1f} | {uni / t:.2f}x |")
    # The same comparison on an ideal network with every Linear costing 1 (backward 2): the gain to expect.
    acts = [get_schedule("1f1b").actions(s, P, m) for s in range(P)]
    ideal = {}
    for method in ("uniform", "flops"):
        bounds = b[method]
        units = [sum(6 if k == 0 else 1 for k in range(bounds[s], bounds[s + 1])) for s in range(P)]
        lines = replay(acts, 1, duration=lambda s, k, u=units: u[s] * (1 if acts[s][k][0] == "F" else 2))
        ideal[method] = max(t[-1][4] for t in lines)
    print(f"\nideal-network replay of the same splits (Linear = 1 unit): {ideal['uniform'] / ideal['flops']:.2f}x")


if __name__ == "__main__":
    main()
