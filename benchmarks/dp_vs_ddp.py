"""phalanx DataParallel vs torch DDP: same model, same bucket size, world 2 on gloo.

Run:  python benchmarks/dp_vs_ddp.py [--steps 20 --repeats 5 --bucket-mb 25]

Three models: many small tensors (a deep narrow MLP), a few large ones (a wide
MLP), and a small transformer encoder. Each repeat times phalanx and DDP back
to back (interleaved, order alternating) on the same two ranks; the table shows
the median samples/s of each and the ratio phalanx / DDP (>= 1.00 means phalanx
is at least as fast), against DDP's default and against DDP with
``gradient_as_bucket_view=True`` (the like-for-like peer of phalanx's default). A fourth
runner is a Horovod script's optimizer, ``phalanx.horovod.torch.DistributedOptimizer`` on the
plain model (column "hvd", ratio "hvd/ddp"). The engine runs the mismatch check on the first iteration
only (then the bucket plan is fixed), so its cost is measured separately by
benchmarks/mismatch_check.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def _models():
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


def _bench(model_name: str, steps: int, repeats: int, batch: int, bucket_mb: float):
    import os

    from torch.nn.parallel import DistributedDataParallel as DDP

    import phalanx as px
    import phalanx.horovod.torch as hvd

    os.environ["PHALANX_BUCKET_MB"] = str(bucket_mb)  # hvd.DistributedOptimizer's fusion threshold
    make = _models()[model_name]
    torch.manual_seed(0)
    base, shape, classes = make()
    x = torch.randn((batch,) + shape)
    y = torch.randint(0, classes, (batch,))
    loss_fn = nn.CrossEntropyLoss()

    def clone():
        m, _, _ = make()
        m.load_state_dict(base.state_dict())
        return m

    ddp = DDP(clone(), bucket_cap_mb=bucket_mb)  # buffers synced each forward by default
    # DDP's own zero-copy option, the like-for-like peer of phalanx's default gradient_as_bucket_view=True
    ddp_view = DDP(clone(), bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    ours = px.DataParallel(clone(), bucket_mb=bucket_mb, broadcast_buffers=True)
    plain = clone()
    runners = {"ddp": ddp, "ddp_view": ddp_view, "phalanx": ours, "hvd": plain}
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

    for kind in runners:  # warm-up (DDP and phalanx both rebuild buckets after the first step)
        run(kind, 3)
    times: dict[str, list[float]] = {k: [] for k in runners}
    kinds = list(runners)
    for rep in range(repeats):
        for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:  # rotate who goes first
            times[kind].append(run(kind, steps))
    world = px.size()
    nparams = sum(p.numel() for p in base.parameters())
    ntensors = sum(1 for _ in base.parameters())
    return {k: world * batch * steps / statistics.median(v) for k, v in times.items()}, nparams, ntensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="local batch per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--np", type=int, default=2)
    args = ap.parse_args()
    import phalanx as px

    print(f"world {args.np} gloo, local batch {args.batch}, bucket {args.bucket_mb} MB, "
          f"{args.steps} steps x {args.repeats} interleaved repeats, median samples/s")
    print(f"{'model':<20} {'params':>9} {'tensors':>7} {'ddp':>9} {'ddp view':>9} {'phalanx':>9} "
          f"{'vs ddp':>6} {'vs view':>7} {'hvd':>9} {'hvd/ddp':>7}")
    for name in _models():
        res, nparams, ntensors = px.run(_bench, np=args.np, args=(name, args.steps, args.repeats, args.batch,
                                                                  args.bucket_mb), threads=1, timeout=900)[0]
        ddp, view, ours, hv = res["ddp"], res["ddp_view"], res["phalanx"], res["hvd"]
        print(f"{name:<20} {nparams:>9} {ntensors:>7} {ddp:>9.0f} {view:>9.0f} {ours:>9.0f} "
              f"{ours / ddp:>6.2f} {ours / view:>7.2f} {hv:>9.0f} {hv / ddp:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
