"""What the collective record and the heartbeat cost, beside a DataParallel step.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/heartbeat_cost.py [--calls 200000 --steps 50]

Three figures, one process (no ranks needed for the first two):

* record: one collective's bookkeeping (``RECORD.open`` + ``Handle`` + ``wait`` with the
  entry closed), against the same ``Handle`` without an entry; microseconds per call;
* publish: one heartbeat written to a local TCPStore (the thread does this once a second);
* step: a DataParallel step of benchmarks/dp_vs_ddp.py's "many small" MLP on 2 gloo ranks,
  with the record's per-collective cost times the collectives of one step, as a share of it.

The end-to-end A/B (this tree against the one before the record) is dp_vs_ddp.py run in
each tree back to back::

    PYTHONPATH=/old/tree python benchmarks/dp_vs_ddp.py --steps 20 --repeats 3
    PYTHONPATH=/new/tree python benchmarks/dp_vs_ddp.py --steps 20 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch


def _per_call_us(fn, calls: int) -> float:
    best = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - start) / calls * 1e6)
    return min(best)


def record_cost(calls: int) -> tuple[float, float]:
    from phalanx.comm.collectives import Handle
    from phalanx.runtime.heartbeat import RECORD

    t = torch.ones(161)

    class Done:  # a finished torch work: wait() returns at once
        def wait(self):
            return True

    work = Done()

    def with_record():
        Handle(work, t, None, RECORD.open("allreduce", "dp.bucket0", t)).wait()

    def without():
        h = Handle(None, t)  # no work: no entry is opened
        h._work = work
        h.wait()

    return _per_call_us(with_record, calls), _per_call_us(without, calls)


def publish_cost(calls: int) -> float:
    import torch.distributed as dist

    from phalanx.runtime.heartbeat import Heartbeat
    from phalanx.runtime.store import bound_tcp_store

    store = bound_tcp_store("127.0.0.1", 0, timeout=datetime.timedelta(seconds=30))
    beat = Heartbeat(dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False), 0)
    return _per_call_us(beat.publish, calls)


def _dp_steps(steps: int):
    import phalanx as px
    from phalanx.runtime.heartbeat import RECORD

    layers = []
    for _ in range(60):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = px.DataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), *layers, torch.nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    times, seqs = [], []
    for _ in range(steps):
        seq = RECORD.seq
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        seqs.append(RECORD.seq - seq)
    return statistics.median(times[steps // 5:]), statistics.median(seqs[steps // 5:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    import os

    import phalanx as px

    rec, base = record_cost(args.calls)
    pub = publish_cost(max(100, args.calls // 100))
    step_s, per_step = px.run(_dp_steps, np=2, args=(args.steps,))[0]
    print(f"cpu threads {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
    print(f"record per collective: {rec:.2f} us with, {base:.2f} us without -> {rec - base:.2f} us")
    print(f"heartbeat publish (once a second): {pub:.1f} us")
    share = (rec - base) * per_step / (step_s * 1e6) * 100
    print(f"DataParallel step ('many small', 2 ranks): {step_s * 1e3:.2f} ms, {per_step} recorded collectives "
          f"-> record {share:.3f}% of the step; heartbeat {pub / 1e4:.4f}% of each second")


if __name__ == "__main__":
    main()
