"""What uneven-data support costs per step: phalanx DistributedOptimizer vs torch DDP with ``Join``.

Run:  python benchmarks/join_flag.py [--steps 30 --repeats 7]

``phalanx.DistributedOptimizer`` (and so ``hvd.DistributedOptimizer``) is always ready for
``join()``: each rank's "I am stepping" rides as one extra element in the step's first bucket
(``phalanx.parallel.data.joined``; before, every step started with a small separate allreduce),
and the steps run on the world's ``steps_group()``.
torch DDP pays a similar allreduce per forward, but only inside ``with Join([model]):``. On two
gloo ranks, for a small MLP (the worst case: the extra round trip weighs most when a step is
short) and a larger one, each repeat times back to back, in alternating order:

- phalanx: DistributedOptimizer as shipped (join flag on);
- phalanx with ``join_ready=False`` (no flag, the default group: the step without join support);
- DDP, and DDP inside ``Join`` (its uneven-input mode).

The table shows the median step time of each and the ratios on/off (phalanx) and Join/plain (DDP).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def _models():
    return {
        "small MLP (34 K params)": lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64),
                                                         nn.ReLU(), nn.Linear(64, 10)),
        "wide MLP (6.3 M params)": lambda: nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                                                         nn.ReLU(), nn.Linear(2048, 10)),
    }


def _bench(name: str, steps: int, repeats: int, batch: int):
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    import phalanx as px

    torch.manual_seed(0)
    base = _models()[name]()
    x = torch.randn(batch, base[0].in_features)
    y = torch.randint(0, 10, (batch,))
    loss_fn = nn.CrossEntropyLoss()

    def clone():
        m = _models()[name]()
        m.load_state_dict(base.state_dict())
        return m

    px_on = clone()
    opt_on = px.DistributedOptimizer(torch.optim.SGD(px_on.parameters(), lr=0.01), px_on.named_parameters())
    px_off = clone()
    opt_off = px.DistributedOptimizer(torch.optim.SGD(px_off.parameters(), lr=0.01), px_off.named_parameters(),
                                      join_ready=False)
    ddp = DDP(clone())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def px_step(model, opt):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    def ddp_step():
        ddp_opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        ddp_opt.step()

    def timed(fn, join=False):
        px.barrier()
        t0 = time.perf_counter()
        if join:
            with Join([ddp]):
                for _ in range(steps):
                    fn()
        else:
            for _ in range(steps):
                fn()
        px.barrier()
        return (time.perf_counter() - t0) / steps * 1e3

    runs = {"px_on": lambda: timed(lambda: px_step(px_on, opt_on)),
            "px_off": lambda: timed(lambda: px_step(px_off, opt_off)),
            "ddp": lambda: timed(ddp_step),
            "ddp_join": lambda: timed(ddp_step, join=True)}
    for fn in runs.values():  # warm-up: bucket rebuilds, first-iteration checks
        fn()
    times = {k: [] for k in runs}
    order = list(runs)
    for r in range(repeats):
        for k in (order if r % 2 == 0 else order[::-1]):
            times[k].append(runs[k]())
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    args = ap.parse_args()

    import phalanx as px

    print(f"2 gloo ranks, {args.steps} steps per timing, {args.repeats} interleaved repeats, median ms/step")
    print(f"{'model':26} {'px on':>8} {'px off':>8} {'on/off':>7} {'DDP':>8} {'DDP+Join':>9} {'Join/DDP':>9}")
    for name in _models():
        m = px.run(_bench, np=2, args=(name, args.steps, args.repeats, args.batch), timeout=600)[0]
        print(f"{name:26} {m['px_on']:8.3f} {m['px_off']:8.3f} {m['px_on'] / m['px_off']:7.3f} "
              f"{m['ddp']:8.3f} {m['ddp_join']:9.3f} {m['ddp_join'] / m['ddp']:9.3f}")


if __name__ == "__main__":
    main()
