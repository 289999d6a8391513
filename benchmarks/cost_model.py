"""Cost model: predicted vs measured data-parallel step time, with and without fp16 compression.

Run: python benchmarks/cost_model.py [--np 2] [--hidden 1024] [--repeats 3]
     python benchmarks/cost_model.py --cluster 2 --rate 1gbit     (root: simulated hosts, 1 rank each)

Each repeat, on N real gloo ranks (loopback, or the simulated hosts):
  1. calibrate on the layout's own buckets (calibrate.measure_buckets), once on float32
     payloads (compression none) and once on float16 (fp16): the buckets DataParallel will
     make (the engine's rule, from the order the plain model's gradients arrive), sent back
     to back with no compute -> alpha/beta by plain least squares; the backward alone, then
     the buckets; and each bucket launched from a gradient hook as the engine does -> the
     overlap e and the waiting term. Communication only is timed for the link; nothing is
     fitted to the measured DataParallel step;
  2. time fp16 compress+decompress per byte -> codec cost;
  3. time, interleaved in rounds, the plain step (compute) and the DataParallel step with
     compression none and fp16; medians;
  4. predict the DataParallel step with plan.predict from 1-3 (the same buckets, ready as
     their bytes are done); for contrast, one term changed at a time: the link from isolated
     messages (calibrate.measure_link, 8 B .. 16 MB), e = 0, equal buckets.
Prints every repeat's parts, predicted vs measured and the error; the goal is every repeat within 20%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

import phalanx as px
from phalanx.planner import calibrate, cost, plan


def _model(hidden):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _body(hidden, batch, bucket_mb, rounds=12, steps=5):
    n = px.size()
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    net = _model(hidden)
    params = sum(p.numel() for p in net.parameters())
    opts = {"plain": (net, torch.optim.SGD(net.parameters(), lr=0.01))}

    def step(name):
        model, opt = opts[name]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    loss = []  # the probes overlap communication with backward, as DataParallel does: forward untimed

    def backward():
        loss.pop().backward()
        opts["plain"][1].zero_grad()

    def forward():
        loss.append(torch.nn.functional.cross_entropy(net(x), y))

    # the layout's own buckets, back to back and under backward, on the payload dtype of each layout
    probes = {comp: calibrate.measure_buckets(list(net.parameters()), backward, bucket_mb=bucket_mb, prepare=forward,
                                              dtype=torch.float16 if comp == "fp16" else torch.float32, rounds=21)
              for comp in ("none", "fp16")}
    # for contrast: the link from isolated messages of assorted sizes (8 B .. 16 MB)
    isolated = {"none": calibrate.measure_link(dtype=torch.float32, rounds=15)[0],
                "fp16": calibrate.measure_link(dtype=torch.float16, rounds=15)[0]}
    flat = torch.randn(params)
    flat.half().float()
    codec = statistics.median(_timed(lambda: flat.half().float()) for _ in range(15)) / (params * 4)
    for comp in ("none", "fp16"):
        model = px.DataParallel(_model(hidden), bucket_mb=bucket_mb, compression=None if comp == "none" else comp)
        opts[comp] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    times = {k: [] for k in opts}
    for r in range(rounds + 1):  # round 0 warms up (and lets DataParallel fix its buckets)
        for name in opts:
            px.barrier()
            took = [_timed(lambda name=name: step(name)) for _ in range(steps)]
            if r:
                times[name] += took
    med = px.allreduce(torch.tensor([statistics.median(times[k]) for k in opts], dtype=torch.float64),
                       op=px.Max).tolist()
    compute = med[0]
    out = {"compute_ms": compute * 1e3, "params": params, "codec_ns_per_byte": codec * 1e9}
    engine_buckets = [b.nbytes for b in opts["none"][0]._engine.buckets.buckets]
    for comp, measured in zip(("none", "fp16"), med[1:]):
        probe = probes[comp]
        link, e = probe.fit(n)
        # compute_s is per global batch on one rank; backward is the probe's share of the plain step
        spec = plan.ModelSpec(params=params, compute_s=compute * n, wait_s=probe.wait_s,
                              tensor_bytes=probe.tensor_bytes, backward_fraction=min(1.0, probe.compute_s / compute))
        # calibrated on the whole world, so the link is the slowest one a flat ring crosses
        cluster = cost.Cluster(hosts=px.cross_size(), ranks_per_host=n // px.cross_size(), intra=link, inter=link,
                               overlap=e)
        layout = plan.Layout(dp=n, compression=comp, bucket_mb=bucket_mb)
        codecs = {"fp16": (0.5, codec)}
        pred = plan.predict(spec, cluster, layout, codecs=codecs)
        iso = cost.Cluster(cluster.hosts, cluster.ranks_per_host, isolated[comp], isolated[comp], overlap=e)
        out[comp] = (pred.step_s, measured)
        # contrasts, from the same calibration: one term changed at a time
        out[comp + "_isolated"] = plan.predict(spec, iso, layout, codecs=codecs).step_s
        out[comp + "_serial"] = plan.predict(spec, dataclasses.replace(cluster, overlap=0.0), layout,
                                             codecs=codecs).step_s
        out[comp + "_equal"] = plan.predict(dataclasses.replace(spec, tensor_bytes=()), cluster, layout,
                                            codecs=codecs).step_s
        out[comp + "_parts"] = {k: v * 1e3 for k, v in pred.parts.items() if k.endswith("_s")}
        out[comp + "_probe"] = {"alpha_us": link.alpha_s * 1e6,
                                "gbps": 8 / link.beta_s / 1e9 if link.beta_s else float("inf"), "e": e,
                                "buckets_kb": [round(b / 1e3) for b in probe.bucket_bytes],
                                "bucket_ms": [round(t * 1e3, 2) for t in probe.bucket_s],
                                **{k: getattr(probe, k) * 1e3 for k in
                                   ("compute_s", "comm_s", "serial_s", "both_s", "wait_s")}}
    out["engine_buckets_kb"] = [round(b / 1e3) for b in engine_buckets]
    for name in ("none", "fp16"):
        opts[name][0]._engine.remove_hooks()
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _on_cluster(args) -> dict:
    import subprocess
    import sys

    from phalanx.testing.cluster import IFNAME, SimCluster

    with SimCluster(hosts=args.cluster, rate=args.rate, ssh=True) as c:
        cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(args.cluster), "-H", c.host_spec(1),
               "--ssh-config", c.ssh_config, "--network-interface", IFNAME, "--",
               # the workers run this file by path: give them the checkout's phalanx too
               "env", f"PYTHONPATH={os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}", sys.executable,
               os.path.abspath(__file__), "--worker", "--hidden", str(args.hidden), "--batch", str(args.batch),
               "--bucket-mb", str(args.bucket_mb)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if "RESULT " in ln), None)
    if line is None:
        raise SystemExit(f"cluster run failed ({proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return json.loads(line.split("RESULT ", 1)[1])


def _fmt(parts) -> str:
    return "{" + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in (parts or {}).items()) + "}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64, help="local batch per rank")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", type=int, default=0, help="simulated hosts (root), one rank each")
    ap.add_argument("--rate", default="1gbit", help="simulated link rate")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # one repeat under `phalanx run` on the simulated cluster
        torch.set_num_threads(1)  # as px.run gives each of 2 ranks on 2 cores
        px.init()
        res = _body(args.hidden, args.batch, args.bucket_mb)
        if px.rank() == 0:
            print("RESULT", json.dumps(res), flush=True)
        return
    rows = []
    for r in range(args.repeats):
        if args.cluster:
            res = _on_cluster(args)
        else:
            res = px.run(_body, np=args.np, args=(args.hidden, args.batch, args.bucket_mb), timeout=600)[0]
        rows.append(res)
        print(f"repeat {r}: compute {res['compute_ms']:.1f} ms, {res['params'] / 1e6:.2f}M params, codec "
              f"{res['codec_ns_per_byte']:.2f} ns/B, DataParallel's buckets {res['engine_buckets_kb']} KB", flush=True)
        for comp in ("none", "fp16"):
            p = res[comp + "_probe"]
            print(f"  {comp:>4}: buckets {p['buckets_kb']} KB back to back {p['bucket_ms']} ms -> alpha "
                  f"{p['alpha_us']:.0f} us, {p['gbps']:.2f} Gbit/s; backward {p['compute_s']:.1f}, buckets "
                  f"{p['comm_s']:.1f}, one after the other {p['serial_s']:.1f} (waiting {p['wait_s']:.1f}), "
                  f"launched from hooks {p['both_s']:.1f} ms -> e {p['e']:.2f}; predicted parts (ms) "
                  f"{_fmt(res[comp + '_parts'])}; predicted {res[comp][0] * 1e3:.2f} measured "
                  f"{res[comp][1] * 1e3:.2f} ({(res[comp][0] - res[comp][1]) / res[comp][1]:+.1%})", flush=True)
    print(f"\n{'compression':>11} {'predicted ms':>13} {'measured ms':>12} {'error':>7}   "
          f"(median of {args.repeats}; every repeat's error)")
    ok = True
    for comp in ("none", "fp16"):
        errs = [(r[comp][0] - r[comp][1]) / r[comp][1] for r in rows]
        ok &= all(abs(e) <= 0.20 for e in errs)
        pred = statistics.median(r[comp][0] for r in rows) * 1e3
        meas = statistics.median(r[comp][1] for r in rows) * 1e3
        print(f"{comp:>11} {pred:>13.2f} {meas:>12.2f} {(pred - meas) / meas:>+7.1%}   "
              + " ".join(f"{e:+.1%}" for e in errs))
    print(f"every repeat within 20%: {'yes' if ok else 'NO'}")
    for key, what in (("isolated", "the link from isolated messages (8 B .. 16 MB)"),
                      ("serial", "e = 0 (nothing hides behind backward)"),
                      ("equal", "ceil(bytes / bucket) equal buckets ready at even steps of backward")):
        print(f"\ncontrast, every other term as above but {what}:")
        for comp in ("none", "fp16"):
            errs = [(r[comp + "_" + key] - r[comp][1]) / r[comp][1] for r in rows]
            pred = statistics.median(r[comp + "_" + key] for r in rows) * 1e3
            meas = statistics.median(r[comp][1] for r in rows) * 1e3
            print(f"{comp:>11} {pred:>13.2f} {meas:>12.2f} {(pred - meas) / meas:>+7.1%}   "
                  + " ".join(f"{e:+.1%}" for e in errs))

if __name__ == "__main__":
    main()
