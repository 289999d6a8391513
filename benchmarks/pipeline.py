"""Pipeline benchmark: bubble vs the formula, phalanx 1F1B vs torch.distributed.pipelining, and the
cost-balanced split vs the uniform one — all in one run on p = 2 CPU ranks (gloo, 1 thread each).

Run:  python benchmarks/pipeline.py [--width 512] [--micro-rows 32] [--repeats 10]

1. Bubble: for m = 1, 2, 4, 8, each stage times its own compute (forward + backward)
   inside a phalanx 1F1B step; measured bubble = 1 - compute / step time (median over
   repeats, mean over stages), next to (p-1)/(m+p-1). Communication counts as bubble.
2. Throughput at m = 8 on the same stages (same weights): phalanx 1F1B vs
   torch.distributed.pipelining.Schedule1F1B, repeats interleaved, medians.
3. A model with one block 6× heavier than the others: the "time"-measured
   min-bottleneck split vs the uniform split, phalanx 1F1B step time, interleaved.
"""

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import phalanx as px
from phalanx.parallel.pipeline import PipelineStage, bubble_fraction, partition

P = 2


def _blocks(width, n, heavy=0):
    torch.manual_seed(0)
    blocks = []
    for i in range(n):
        depth = heavy if (heavy and i == 0) else 1
        blocks.append(nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]))
    return nn.Sequential(*blocks)


def _loss(out, y):
    return (out - y).pow(2).mean()


def _timed(fn):
    px.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rank_body(width, micro_rows, repeats):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B

    torch.set_num_threads(1)
    r = px.rank()
    last = r == P - 1
    model = _blocks(width, 8)
    stage_mod = partition(model, P, method="uniform").split(model)[r]
    px_stage = PipelineStage(stage_mod, r, P, loss_fn=_loss if last else None)
    out = {"bubble": {}, "px": [], "torch": [], "uniform": [], "balanced": []}

    def batch(m):
        g = torch.Generator().manual_seed(m)
        return torch.randn(m * micro_rows, width, generator=g), torch.randn(m * micro_rows, width, generator=g)

    # 1. bubble
    for m in (1, 2, 4, 8):
        x, y = batch(m)
        fracs = []
        for rep in range(repeats + 1):
            step_s = _timed(lambda x=x, y=y, m=m: px_stage.step(x, y, num_microbatches=m, schedule="1f1b"))
            stage_mod.zero_grad()
            if rep:  # the first is a warm-up
                fracs.append(1.0 - px_stage.busy_s / step_s)
        out["bubble"][m] = statistics.median(fracs)

    # 2. phalanx vs torch.distributed.pipelining on the same stage weights
    m = 8
    x, y = batch(m)
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

    torch_step()
    px_step()
    for _ in range(repeats):
        out["px"].append(_timed(px_step))
        out["torch"].append(_timed(torch_step))

    # 3. one heavy block: measured-cost split vs uniform split
    heavy = _blocks(width, 8, heavy=6)
    sample = torch.randn(micro_rows, width)
    splits = {}
    for method in ("uniform", "time"):
        bounds = px.broadcast_object(partition(heavy, P, method=method, sample=sample).bounds, root_rank=0)
        mod = nn.Sequential(*list(heavy.children())[bounds[r] : bounds[r + 1]])
        splits[method] = (bounds, PipelineStage(mod, r, P, loss_fn=_loss if last else None), mod)
    out["bounds"] = {k: v[0] for k, v in splits.items()}

    def heavy_step(method):
        _, st, mod = splits[method]
        st.step(x, y, num_microbatches=m, schedule="1f1b")
        mod.zero_grad()

    heavy_step("uniform")
    heavy_step("time")
    for _ in range(repeats):
        out["uniform"].append(_timed(lambda: heavy_step("uniform")))
        out["balanced"].append(_timed(lambda: heavy_step("time")))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--micro-rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    res = px.run(_rank_body, np=P, args=(a.width, a.micro_rows, a.repeats), timeout=900)

    print(f"p={P} stages, 8 blocks of Linear({a.width},{a.width})+ReLU, {a.micro_rows} rows per micro-batch, "
          f"{a.repeats} repeats (median)\n")
    print("| m | measured bubble (mean of stages) | formula (p-1)/(m+p-1) | measured / formula |")
    print("|---|---|---|---|")
    for m in (1, 2, 4, 8):
        measured = statistics.mean(r["bubble"][m] for r in res)
        formula = bubble_fraction(P, m)
        print(f"| {m} | {measured:.3f} | {formula:.3f} | {measured / formula:.2f} |")

    def med(key):  # a step ends when its slowest rank ends
        return statistics.median(max(r[key][i] for r in res) for i in range(a.repeats))

    px_s, torch_s = med("px"), med("torch")
    rows = 8 * a.micro_rows
    print("\n| 1F1B, m=8 | step (ms) | samples/s |")
    print("|---|---|---|")
    print(f"| phalanx | {px_s * 1e3:.1f} | {rows / px_s:,.0f} |")
    print(f"| torch.distributed.pipelining | {torch_s * 1e3:.1f} | {rows / torch_s:,.0f} |")
    print(f"\nphalanx / torch throughput ratio: {torch_s / px_s:.2f}x")

    uni, bal = med("uniform"), med("balanced")
    b = res[0]["bounds"]
    print("\n| heavy first block, m=8 | bounds | step (ms) |\n|---|---|---|")
    print(f"| uniform split | {b['uniform']} | {uni * 1e3:.1f} |")
    print(f"| measured-time min-bottleneck split | {b['time']} | {bal * 1e3:.1f} |")
    print(f"\nbalanced / uniform speedup: {uni / bal:.2f}x")


if __name__ == "__main__":
    main()
