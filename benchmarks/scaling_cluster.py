"""The cost model where it can be measured: 2, 4, 8 simulated hosts, flat and hierarchical data parallel.

Run (root; needs ip, tc, sshd; takes the benchmark lock itself is NOT done: wrap it)::

    flock /tmp/phalanx-bench.lock python benchmarks/scaling_cluster.py [--hosts 2,4,8] [--rate 200mbit]

For each size it brings up ``phalanx cluster up``-style hosts (network namespaces on
a bridge, every host's link capped by ``tc tbf`` at ``--rate`` both ways), runs 2
ranks per host through the real SSH launch path, and times, interleaved in rounds:

- ``local``: the same model and batch with no gradient sync (each rank alone);
- ``sync``: the local step, then one 8-byte allreduce (what waiting for the slowest rank costs);
- ``flat``: ``DataParallel(algorithm="flat")``, gloo's ring over all ranks;
- ``hierarchical``: ``DataParallel(algorithm="hierarchical")``: reduce-scatter in the
  host, ring across hosts, allgather in the host (phalanx.comm.algorithms).

The model stands in for an accelerator: 16 Linear(256, 256) layers (1.05M parameters,
4.2 MB of fp32 gradients) whose forward and backward each *sleep* per layer
(``--fwd-ms``, ``--bwd-ms``), as a GPU's kernels would run while the host's cores
stay free for communication. Real compute per rank is tiny (batch 8 of 256 wide), so
16 ranks on 2 cores are oversubscribed only for that small part; the capped link
dominates. Efficiency is ``local / DataParallel`` at the same size (weak scaling:
the same work per rank, no communication).

Prediction, from nothing measured on the DataParallel steps: the measured ``local``
step (compute) + the gradient sync left exposed after backward
(``cost.overlapped_exposure``), with the engine's buckets (``cost.bucket_sizes``) ready
as backward reaches them, each an allreduce over the simulated hardware
(``hardware.simulated(rate)``: the tc rate per host, shared by the rings leaving it;
loopback between a host's two ranks as measured on cpu2), via
``scaling.allreduce_time``. Overlap ``e = 1``: the device sleeps, the cores are free.
A second prediction keeps that bandwidth but takes the per-step latency and the waiting
from the job's own ranks, with no gradient traffic: alpha = an isolated 8-byte allreduce
over the world / 2(n-1), waiting = ``sync - local - that allreduce`` (16 ranks on 2 busy
cores wait for the scheduler at every ring step, which cpu2's 2-rank loopback alpha does
not know).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAYERS, WIDTH, BATCH = 16, 256, 8


def _rate_bits(rate: str) -> float:
    r = rate.lower().removesuffix("bit")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(r[-1], 1.0)
    return float(r[:-1] if r[-1] in "kmg" else r) * scale


def _worker(args) -> None:
    import torch

    import phalanx as px

    class Device(torch.autograd.Function):
        """Identity whose forward and backward sleep: accelerator time that leaves the cores free."""

        @staticmethod
        def forward(ctx, x):
            time.sleep(args.fwd_ms / 1e3)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            time.sleep(args.bwd_ms / 1e3)
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(Device.apply(x)))
            return x

    torch.set_num_threads(1)
    px.init()
    from phalanx.planner import calibrate

    # the link as measured: isolated flat allreduces over the whole world (no model, no DataParallel)
    link, samples = calibrate.measure_link((8, 2**16, 2**20, 2**22), rounds=5, warmup=1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    arms = {"local": Net(), "sync": Net()}  # sync: the local step, then one 8-byte allreduce (waiting + latency)
    arms["flat"] = px.DataParallel(Net(), bucket_mb=args.bucket_mb, algorithm="flat")
    arms["hierarchical"] = px.DataParallel(Net(), bucket_mb=args.bucket_mb, algorithm="hierarchical")
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in arms.items()}
    tiny = torch.zeros(2)

    def step(name):
        loss = torch.nn.functional.mse_loss(arms[name](x), y)
        loss.backward()
        if name == "sync":
            torch.distributed.all_reduce(tiny)
        opts[name].step()
        opts[name].zero_grad()

    times = {k: [] for k in arms}
    for r in range(args.rounds + 1):  # round 0 warms up (connections, DataParallel's bucket rebuild)
        order = list(arms) if r % 2 else list(arms)[::-1]
        for name in order:
            px.barrier()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(name)
                if r:
                    times[name].append(time.perf_counter() - t0)
    med = px.allreduce(torch.tensor([statistics.median(times[k]) for k in arms], dtype=torch.float64),
                       op=px.Max).tolist()
    tensor_bytes = [p.numel() * 4 for p in reversed(list(arms["local"].parameters()))]
    if px.rank() == 0:
        print("RESULT", json.dumps({"ranks": px.size(), "hosts": px.cross_size(), "median_s": dict(zip(arms, med)),
                                    "tensor_bytes": tensor_bytes,
                                    "link": {"alpha_s": link.alpha_s, "beta_s": link.beta_s},
                                    "link_samples": samples}), flush=True)
    px.shutdown()


def predict(res: dict, rate_bits: float, bucket_mb: float, fwd_ms: float, bwd_ms: float,
            calibrated: bool = False) -> dict:
    """``calibrated=False``: the profile alone: the tc rate, cpu2's loopback latency (2 ranks), no waiting.
    True: the same bandwidth, but the per-step latency and the waiting measured on this job's ranks
    without any gradient traffic: alpha = an isolated 8-byte allreduce over the world / 2(n-1) steps,
    waiting = (local step + one 8-byte allreduce) - local step - that allreduce."""
    import dataclasses

    from phalanx.planner import cost, hardware, scaling

    hosts, ranks = res["hosts"], res["ranks"]
    hw = hardware.simulated(rate_bits, ranks_per_host=ranks // hosts)
    wait = 0.0
    if calibrated:
        tiny = res["link_samples"][0][1]
        alpha = tiny / (2 * (ranks - 1))
        wait = max(0.0, res["median_s"]["sync"] - res["median_s"]["local"] - tiny)
        hw = dataclasses.replace(hw, network=dataclasses.replace(hw.network, latency_s=alpha),
                                 node=dataclasses.replace(hw.node, latency_s=alpha))
    local = res["median_s"]["local"]
    backward = local * bwd_ms / (fwd_ms + bwd_ms)
    sizes = cost.bucket_sizes(res["tensor_bytes"], bucket_mb * 2**20)
    ready = cost.ready_fractions(sizes)
    out = {}
    for alg, name in (("ring", "flat"), ("hierarchical", "hierarchical")):
        times = [scaling.allreduce_time(b, hw, ranks, 1, alg) for b in sizes]
        exposed = cost.overlapped_exposure(times, backward, 1.0, ready)
        out[name] = {"predicted_s": local + wait + exposed, "measured_s": res["median_s"][name],
                     "sync_s": sum(times), "exposed_s": exposed, "wait_s": wait}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="2,4,8")
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--fwd-ms", type=float, default=5.0, help="device time per layer, forward")
    ap.add_argument("--bwd-ms", type=float, default=25.0, help="device time per layer, backward")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return 0
    from phalanx.testing.cluster import IFNAME, SimCluster

    rows = []
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for hosts in (int(h) for h in args.hosts.split(",")):
        t0 = time.time()
        with SimCluster(hosts=hosts, rate=args.rate, ssh=True) as c:
            cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(hosts * args.ranks_per_host),
                   "-H", c.host_spec(args.ranks_per_host), "--ssh-config", c.ssh_config,
                   "--network-interface", IFNAME, "--", "env", f"PYTHONPATH={here}", sys.executable,
                   os.path.abspath(__file__), "--worker", "--bucket-mb", str(args.bucket_mb),
                   "--fwd-ms", str(args.fwd_ms), "--bwd-ms", str(args.bwd_ms), "--rounds", str(args.rounds),
                   "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in proc.stdout.splitlines() if "RESULT " in ln), None)
        if line is None:
            print(f"{hosts} hosts failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            return 1
        res = json.loads(line.split("RESULT ", 1)[1])
        res["pred"] = predict(res, _rate_bits(args.rate), args.bucket_mb, args.fwd_ms, args.bwd_ms)
        res["pred_cal"] = predict(res, _rate_bits(args.rate), args.bucket_mb, args.fwd_ms, args.bwd_ms, True)
        res["wall_s"] = time.time() - t0
        res["load"] = os.getloadavg()[0]
        rows.append(res)
        local = res["median_s"]["local"]
        fit = res["link"]
        print(f"{hosts} hosts x {args.ranks_per_host} ranks ({res['wall_s']:.0f} s, load {res['load']:.1f}): "
              f"local {local * 1e3:.1f} ms, local + 8-byte allreduce {res['median_s']['sync'] * 1e3:.1f} ms; isolated "
              f"8-byte allreduce {res['link_samples'][0][1] * 1e3:.2f} ms; link fitted to isolated allreduces: "
              f"alpha {fit['alpha_s'] * 1e6:.0f} us, "
              f"{8 / fit['beta_s'] / 1e6 if fit['beta_s'] else float('inf'):.0f} Mbit/s", flush=True)
        for name, p in list(res["pred"].items()) + [(k + " +cal", v) for k, v in res["pred_cal"].items()]:
            err = (p["predicted_s"] - p["measured_s"]) / p["measured_s"]
            print(f"  {name:>17}: predicted {p['predicted_s'] * 1e3:7.1f} ms (sync {p['sync_s'] * 1e3:.1f}, exposed "
                  f"{p['exposed_s'] * 1e3:.1f}, waiting {p['wait_s'] * 1e3:.1f}), measured {p['measured_s'] * 1e3:7.1f} ms, error {err:+.1%}; "
                  f"efficiency predicted {local / p['predicted_s']:.0%} measured {local / p['measured_s']:.0%}",
                  flush=True)
    for key, what in (("pred", "link = the tc rate (the profile)"),
                      ("pred_cal", "+ latency and waiting measured on the job's ranks (no gradient traffic)")):
        print(f"\n{what}\n{'hosts':>5} {'ranks':>5} {'algorithm':>12} {'pred ms':>8} {'meas ms':>8} {'error':>7} "
              f"{'pred eff':>8} {'meas eff':>8}")
        for res in rows:
            local = res["median_s"]["local"]
            for name, p in res[key].items():
                err = (p["predicted_s"] - p["measured_s"]) / p["measured_s"]
                print(f"{res['hosts']:>5} {res['ranks']:>5} {name:>12} {p['predicted_s'] * 1e3:8.1f} "
                      f"{p['measured_s'] * 1e3:8.1f} {err:>+7.1%} {local / p['predicted_s']:>8.0%} "
                      f"{local / p['measured_s']:>8.0%}")
        for name in ("flat", "hierarchical"):
            knee = {kind: next((r["hosts"] for r in rows if r["median_s"]["local"] / r[key][name][kind] < 0.8),
                               None) for kind in ("predicted_s", "measured_s")}
            print(f"{name}: first size below 80% efficiency: predicted {knee['predicted_s']} hosts, measured "
                  f"{knee['measured_s']} hosts")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
