"""phalanx DataParallel and hvd.DistributedOptimizer vs torch DDP: same model, same bucket size, world 2 on gloo.

Run:  python benchmarks/dp_vs_ddp.py [--steps 10 --repeats 24 --bucket-mb 25 --models "small transformer"]

Three models: many small tensors (a deep narrow MLP), a few large ones (a wide
MLP), and a small transformer encoder. Four runners share the two ranks: torch DDP,
DDP with ``gradient_as_bucket_view=True`` (the like-for-like peer of phalanx's default),
``px.DataParallel``, and a Horovod script's optimizer
(``phalanx.horovod.torch.DistributedOptimizer`` on the plain model, "hvd").

The verdict is paired: each repeat times every runner for ``--steps`` steps back to back,
in the order hvd, ddp, phalanx, ddp view (reversed every other repeat, so each pair that is
compared ran next to each other and each went first as often as second), and each ratio
(phalanx/ddp, phalanx/ddp view, hvd/ddp; >= 1.00 means phalanx is at least as fast) is
taken within a repeat. Load from other processes moves both sides of a pair together, so
the per-repeat ratios scatter far less than the runs themselves (DDP vs DDP view moves by
15% between runs on a shared 2-core machine). The second table gives, for each ratio, the
median over the repeats, the interquartile range, min-max, and a 95% confidence interval
of the median (distribution-free: order statistics of the binomial); the verdict says
">= 1" or "< 1" only when that interval lies on one side of 1.00. The engine runs the
mismatch check on the first iteration only (then the bucket plan is fixed), so its cost is
measured separately by benchmarks/mismatch_check.py.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn


def models():
    def many_small():
        layers = []
        for _ in range(60):
            layers += [nn.Linear(64, 64), nn.ReLU()]
        return nn.Sequential(nn.Linear(32, 64), *layers, nn.Linear(64, 10)), (32,), 10

    def few_large():
        return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                             nn.Linear(2048, 10)), (512,), 10

    def transformer():
        layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
        return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Flatten(),
                             nn.Linear(128 * 16, 10)), (16, 128), 10

    return {"many small tensors": many_small, "few large tensors": few_large, "small transformer": transformer}


ORDER = ("hvd", "ddp", "phalanx", "ddp_view")  # each compared pair adjacent: hvd|ddp, ddp|phalanx, phalanx|view
RATIOS = (("phalanx/ddp", "phalanx", "ddp"), ("phalanx/view", "phalanx", "ddp_view"), ("hvd/ddp", "hvd", "ddp"))


def _bench(model_name: str, steps: int, repeats: int, batch: int, bucket_mb: float):
    import os

    from torch.nn.parallel import DistributedDataParallel as DDP

    import phalanx as px
    import phalanx.horovod.torch as hvd

    os.environ["PHALANX_BUCKET_MB"] = str(bucket_mb)  # hvd.DistributedOptimizer's fusion threshold
    make = models()[model_name]
    torch.manual_seed(0)
    base, shape, classes = make()
    x = torch.randn((batch,) + shape)
    y = torch.randint(0, classes, (batch,))
    loss_fn = nn.CrossEntropyLoss()

    def clone():
        m, _, _ = make()
        m.load_state_dict(base.state_dict())
        return m

    plain = clone()
    runners = {
        "ddp": DDP(clone(), bucket_cap_mb=bucket_mb),  # buffers synced each forward by default
        # DDP's own zero-copy option, the like-for-like peer of phalanx's default gradient_as_bucket_view=True
        "ddp_view": DDP(clone(), bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True),
        "phalanx": px.DataParallel(clone(), bucket_mb=bucket_mb, broadcast_buffers=True),
        "hvd": plain,
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in runners.items()}
    opts["hvd"] = hvd.DistributedOptimizer(opts["hvd"], named_parameters=plain.named_parameters())
    hvd.broadcast_parameters(plain.state_dict(), root_rank=0)

    def run(kind, n):
        model, opt = runners[kind], opts[kind]
        px.barrier()
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        px.barrier()
        return time.perf_counter() - start

    for kind in ORDER:  # warm-up (DDP and phalanx both rebuild buckets after the first step)
        run(kind, 3)
    times: dict[str, list[float]] = {k: [] for k in ORDER}
    for rep in range(repeats):
        for kind in ORDER if rep % 2 == 0 else reversed(ORDER):
            times[kind].append(run(kind, steps))
    nparams = sum(p.numel() for p in base.parameters())
    ntensors = sum(1 for _ in base.parameters())
    return times, px.size() * batch * steps, nparams, ntensors


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median: the k-th smallest and k-th largest
    value, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2; None when even the
    whole range covers less than ``level`` (n < 6 at 95%)."""
    xs, n = sorted(values), len(values)
    tail, k, below = (1 - level) / 2, 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # P(B <= k)
        if below > tail:
            break
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


def summarize(times: dict[str, list[float]], samples: int) -> dict[str, dict]:
    """Per ratio, from the per-repeat pairs: median, quartiles, min-max, 95% CI of the median, verdict."""
    out = {}
    for label, num, den in RATIOS:
        r = [d / n for n, d in zip(times[num], times[den])]  # samples/s ratio = inverse time ratio
        q1, _, q3 = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else (r[0], r[0], r[0])
        ci = median_ci(r)
        verdict = "too few repeats" if ci is None else ">= 1" if ci[0] >= 1.0 else "< 1" if ci[1] < 1.0 \
            else "unresolved"
        out[label] = {"median": statistics.median(r), "q1": q1, "q3": q3, "min": min(r), "max": max(r),
                      "ci": ci, "verdict": verdict}
    out["rate"] = {k: samples / statistics.median(v) for k, v in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="steps per timed run")
    ap.add_argument("--repeats", type=int, default=24, help="paired repeats (each times all four runners)")
    ap.add_argument("--batch", type=int, default=32, help="local batch per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--models", default=",".join(models()), help="comma-separated subset of the three models")
    args = ap.parse_args()
    import phalanx as px

    names = args.models.split(",")
    unknown = [n for n in names if n not in models()]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {list(models())}")
    print(f"world {args.np} gloo, local batch {args.batch}, bucket {args.bucket_mb} MB, "
          f"{args.steps} steps x {args.repeats} paired repeats")
    rows = {}
    print(f"{'model':<20} {'params':>9} {'tensors':>7} {'ddp':>9} {'ddp view':>9} {'phalanx':>9} {'hvd':>9}"
          "   (median samples/s)")
    for name in names:
        times, samples, nparams, ntensors = px.run(
            _bench, np=args.np, args=(name, args.steps, args.repeats, args.batch, args.bucket_mb),
            threads=1, timeout=900)[0]
        rows[name] = s = summarize(times, samples)
        rate = s["rate"]
        print(f"{name:<20} {nparams:>9} {ntensors:>7} {rate['ddp']:>9.0f} {rate['ddp_view']:>9.0f} "
              f"{rate['phalanx']:>9.0f} {rate['hvd']:>9.0f}", flush=True)
    print(f"\nper-repeat ratios (>= 1.00: phalanx at least as fast), {args.repeats} pairs each")
    print(f"{'model':<20} {'ratio':<13} {'median':>6} {'IQR':>11} {'min-max':>11} {'95% CI of median':>17}  verdict")
    for name, s in rows.items():
        for label, _, _ in RATIOS:
            r = s[label]
            ci = f"{r['ci'][0]:>8.3f}-{r['ci'][1]:<8.3f}" if r["ci"] else f"{'-':^17}"
            print(f"{name:<20} {label:<13} {r['median']:>6.3f} {r['q1']:>5.2f}-{r['q3']:<5.2f} "
                  f"{r['min']:>5.2f}-{r['max']:<5.2f} {ci}  {r['verdict']}")


if __name__ == "__main__":
    main()
