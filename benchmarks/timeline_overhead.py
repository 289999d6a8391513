"""Timeline overhead (on vs off) for DataParallel steps, and the docs' timeline picture.

Run: python benchmarks/timeline_overhead.py [--np 2] [--repeats 5] [--png docs/img/timeline.png]

Each repeat runs 10 steps with the timeline off, then 10 with it on (interleaved),
median step time of each; rank 0 writes the last trace, its breakdown table, and
a Gantt rendering of two steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import phalanx as px
from phalanx.profiler import StepProfiler, breakdown, report, timeline


def _body(repeats, hidden, batch, trace_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                              torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    model = px.DataParallel(net, bucket_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(batch, 256), torch.randint(0, 10, (batch,))) for _ in range(10)]
    prof = StepProfiler()

    def run():
        times = []
        for _, (x, y) in prof.steps(data):
            t0 = time.perf_counter()
            with prof.phase("forward"):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    run()
    off, on, events = [], [], []
    for _ in range(repeats):
        off.append(run())
        timeline.start()
        on.append(run())
        events = timeline.stop(trace_path)
    return {"off": statistics.median(off), "on": statistics.median(on), "events": events}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace", default="timeline.json")
    ap.add_argument("--png", default=None, help="render two steps of the trace to this PNG")
    args = ap.parse_args()
    res = px.run(_body, np=args.np, args=(args.repeats, args.hidden, args.batch, args.trace), timeout=600)[0]
    print(f"{'timeline':>9} {'median step ms':>15}")
    print(f"{'off':>9} {res['off'] * 1e3:>15.2f}\n{'on':>9} {res['on'] * 1e3:>15.2f}")
    print(f"overhead: {res['on'] / res['off'] - 1:+.1%}   trace: {args.trace}")
    bd = breakdown.from_events(res["events"])
    print(bd.table())
    if args.png:
        steps = sorted((e for e in res["events"] if e.get("name") == "step" and e["pid"] == 0),
                       key=lambda e: e["ts"])
        start = steps[4]["ts"] / 1e3
        span = (steps[6]["ts"] - steps[4]["ts"]) / 1e3
        report.render_timeline(res["events"], args.png, start_ms=start, span_ms=span)
        print(f"picture: {args.png}")


if __name__ == "__main__":
    main()
