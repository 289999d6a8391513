"""The cost model where it can be measured: 2, 4, 8 simulated hosts, link-bound on 2 cores.

Run (root; needs ip, tc, sshd; the script does NOT take the benchmark lock: wrap it in scripts/px-bench, which takes the
machine alone)::

    scripts/px-bench timeout 600 python benchmarks/scaling_cluster.py --out run.json

The default does the whole check: five jobs on one 8-host cluster, meant to finish within 8
minutes on a quiet cpu2 (most of it is starting the jobs; each prints its own wall time). It
brings up ``phalanx cluster up``-style hosts once, as many as the largest layout needs (network
namespaces on a bridge, every host's link capped by ``tc tbf`` at ``--rate`` both ways); each
layout ``HOSTSxRANKS`` then runs its ranks on the first HOSTS hosts through the real SSH
launch path and times, interleaved in rounds:

- ``local``: the same model and batch with no gradient sync (each rank alone);
- ``sync``: the local step, then one 8-byte allreduce (what waiting for the slowest rank costs);
- ``flat``: ``DataParallel(algorithm="flat")``, gloo's ring over all ranks;
- ``hierarchical`` (2+ ranks per host only): reduce-scatter in the host, ring across hosts,
  allgather in the host (phalanx.comm.algorithms). With one rank per host it is the flat
  ring cut into 2 MiB calls, so it is not run there.

**Why it is link-bound.** The default layouts are 2, 4 and 8 hosts with ONE rank each
(``2x1,4x1,8x1``), plus flat against hierarchical at two ranks per host where two cores
carry it (``2x2,4x2``; 16 ranks at 8x2 were CPU-bound: docs/scaling.md). The model stands
in for an accelerator: 16 Linear(256, 256) layers (1.05M parameters, 4.2 MB of fp32
gradients) whose forward and backward *sleep* per layer (``--fwd-ms``, ``--bwd-ms``), as a
GPU's kernels run while the host's cores stay free. Real compute is a batch of 8, so eight
processes mostly sleep or wait on a 100 Mbit/s link, and 4.2 MB over it take 0.35-0.62 s.
0.5 MB buckets hold one layer each (16 buckets): at 2 hosts each allreduce (22 ms) keeps up
with a layer's backward (25 ms) and only the last is exposed; from 4 hosts on (33 ms) they
queue behind each other.

**Prediction, with nothing from the DataParallel steps.** ``predicted = local + waiting +
exposed`` where

- ``local``, the forward/backward split and when each gradient is ready come from the
  ``local`` arm (post-accumulate-grad hooks, no communication);
- the buckets are the engine's own plan after its rebuild (``DataParallel``'s bucket
  manager: sizes and which gradients each holds), each launched when its last gradient is
  ready and after the one before it (one process group), each an allreduce over
  ``hardware.simulated(rate)`` via ``planner.scaling.allreduce_time``: the tc rate less the
  TCP/IP/Ethernet headers, shared by the rings leaving a host; ``cost.overlapped_exposure``
  with ``e = 1`` (the device sleeps, the cores are free) gives what is left after backward;
- the per-message latency and the waiting are measured on the job's ranks with no gradient
  traffic: alpha = an isolated 8-byte allreduce over the world / 2(n-1); waiting = ``sync -
  local - that allreduce``.

A second prediction (``profile``) takes alpha from the cpu2 profile (2-rank loopback) and no
waiting, to show what measuring them is worth. The link fitted to isolated allreduces of 8 B,
1 MiB and 4 MiB (``calibrate.measure_link``) is printed beside the tc rate as a check; it is
not used.
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
DEFAULT_LAYOUTS = "2x1,4x1,8x1,2x2,4x2"


def _rate_bits(rate: str) -> float:
    r = rate.lower().removesuffix("bit")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(r[-1], 1.0)
    return float(r[:-1] if r[-1] in "kmg" else r) * scale


def _layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        hosts, _, ranks = item.strip().partition("x")
        if not hosts.isdigit() or not (ranks or "1").isdigit() or int(hosts) < 2:
            raise SystemExit(f"--layouts: {item!r} is not HOSTSxRANKS with 2+ hosts (e.g. 8x1,4x2)")
        out.append((int(hosts), int(ranks or 1)))
    return out


def _worker(args) -> None:
    clock = {"start": time.time()}
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
    clock["imported"] = time.time()
    px.init()
    clock["initialised"] = time.time()
    from phalanx.planner import calibrate

    # the link as measured: isolated flat allreduces over the whole world (no model, no DataParallel)
    link, samples = calibrate.measure_link((8, 2**20, 2**22), rounds=5, warmup=1)
    clock["link"] = time.time()
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    arms = {"local": Net(), "sync": Net()}  # sync: the local step, then one 8-byte allreduce (waiting + latency)
    arms["flat"] = px.DataParallel(Net(), bucket_mb=args.bucket_mb, algorithm="flat")
    if px.local_size() > 1:
        arms["hierarchical"] = px.DataParallel(Net(), bucket_mb=args.bucket_mb, algorithm="hierarchical")
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in arms.items()}
    tiny = torch.zeros(2)
    params = list(arms["local"].parameters())
    stamps = [0.0] * len(params)
    for i, p in enumerate(params):  # when each gradient is ready, in the step with no communication
        p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, time.perf_counter()))

    times = {k: [] for k in arms}
    backward, ready = [], [[] for _ in params]

    def step(name, keep):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(arms[name](x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if name == "sync":
            torch.distributed.all_reduce(tiny)
        opts[name].step()
        opts[name].zero_grad()
        if keep:
            times[name].append(time.perf_counter() - t0)
            if name == "local":
                backward.append(t2 - t1)
                for i, s in enumerate(stamps):
                    ready[i].append(s - t1)

    for r in range(args.rounds + 1):  # round 0 warms up (connections, DataParallel's bucket rebuild)
        order = list(arms) if r % 2 else list(arms)[::-1]
        for name in order:
            px.barrier()
            for _ in range(args.steps):
                step(name, r > 0)
    clock["arms"] = time.time()
    local_vals = [statistics.median(times[k]) for k in arms] + [statistics.median(backward)]
    local_vals += [statistics.median(t) for t in ready]
    slow = px.allreduce(torch.tensor(local_vals, dtype=torch.float64), op=px.Max).tolist()  # the slowest rank
    index = {id(p): i for i, p in enumerate(arms["flat"].module.parameters())}
    plan = [{"bytes": b.nbytes, "params": [index[id(p)] for p in b.params]}
            for b in arms["flat"]._engine.buckets.buckets]  # the engine's plan after its rebuild (launch order)
    if px.rank() == 0:
        print("RESULT", json.dumps({
            "ranks": px.size(), "hosts": px.cross_size(), "median_s": dict(zip(arms, slow)),
            "backward_s": slow[len(arms)], "ready_s": slow[len(arms) + 1:], "buckets": plan,
            "link": {"alpha_s": link.alpha_s, "beta_s": link.beta_s}, "link_samples": samples,
            "clock": clock}), flush=True)
    px.shutdown()


def predict(res: dict, rate_bits: float, calibrated: bool = True) -> dict:
    """Predict each DataParallel arm from the measurements without gradient traffic (see the module doc).

    ``calibrated=False``: the profile alone (cpu2's 2-rank loopback alpha, no waiting)."""
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
    local, backward = res["median_s"]["local"], res["backward_s"]
    sizes = [b["bytes"] for b in res["buckets"]]
    ready = [min(1.0, max(res["ready_s"][i] for i in b["params"]) / backward) for b in res["buckets"]]
    out = {}
    for alg, name in (("ring", "flat"), ("hierarchical", "hierarchical")):
        if name not in res["median_s"]:
            continue
        times = [scaling.allreduce_time(b, hw, ranks, 1, alg) for b in sizes]
        exposed = cost.overlapped_exposure(times, backward, 1.0, ready)
        out[name] = {"predicted_s": local + wait + exposed, "measured_s": res["median_s"][name],
                     "sync_s": sum(times), "exposed_s": exposed, "wait_s": wait}
    return out


def _knees(rows: list, key: str, name: str, per_host: int) -> dict:
    """The first size (hosts) below 80% efficiency, predicted and measured, among one ranks-per-host series."""
    series = sorted((r for r in rows if r["ranks"] // r["hosts"] == per_host and name in r[key]),
                    key=lambda r: r["hosts"])
    return {kind: next((r["hosts"] for r in series if r["median_s"]["local"] / r[key][name][kind] < 0.8), None)
            for kind in ("predicted_s", "measured_s")}


def _report(rows: list) -> None:
    for key, what in (("pred", "alpha and waiting measured on the job's ranks (no gradient traffic)"),
                      ("pred_profile", "profile only: cpu2's loopback alpha, no waiting")):
        print(f"\n{what}\n{'hosts':>5} {'ranks':>5} {'algorithm':>12} {'pred ms':>8} {'meas ms':>8} {'error':>7} "
              f"{'pred eff':>8} {'meas eff':>8}")
        for res in rows:
            local = res["median_s"]["local"]
            for name, p in res[key].items():
                err = (p["predicted_s"] - p["measured_s"]) / p["measured_s"]
                print(f"{res['hosts']:>5} {res['ranks']:>5} {name:>12} {p['predicted_s'] * 1e3:8.1f} "
                      f"{p['measured_s'] * 1e3:8.1f} {err:>+7.1%} {local / p['predicted_s']:>8.0%} "
                      f"{local / p['measured_s']:>8.0%}")
        for per_host in sorted({r["ranks"] // r["hosts"] for r in rows}):
            for name in ("flat", "hierarchical"):
                if not any(name in r[key] and r["ranks"] // r["hosts"] == per_host for r in rows):
                    continue
                knee = _knees(rows, key, name, per_host)
                print(f"{name}, {per_host} rank(s)/host: first size below 80% efficiency: predicted "
                      f"{knee['predicted_s']} hosts, measured {knee['measured_s']} hosts")


def _markdown(rows: list) -> None:
    """The rows of docs/scaling.md's results table and its knee line, ready to paste."""
    print("\ndocs/scaling.md rows:")
    for res in rows:
        local = res["median_s"]["local"]
        for name, p in res["pred"].items():
            err = (p["predicted_s"] - p["measured_s"]) / p["measured_s"]
            prof = res["pred_profile"][name]["predicted_s"]
            print(f"| {res['hosts']}x{res['ranks'] // res['hosts']} ({res['ranks']}) | {name} | "
                  f"{p['predicted_s'] * 1e3:.1f} / {p['measured_s'] * 1e3:.1f} | {err:+.1%} | "
                  f"{(prof - p['measured_s']) / p['measured_s']:+.1%} | "
                  f"{local / p['predicted_s']:.0%} / {local / p['measured_s']:.0%} |")
    knees = []
    for per_host in sorted({r["ranks"] // r["hosts"] for r in rows}):
        for name in ("flat", "hierarchical"):
            if any(name in r["pred"] and r["ranks"] // r["hosts"] == per_host for r in rows):
                k = _knees(rows, "pred", name, per_host)
                knees.append(f"{per_host} rank(s) per host, {name} {k['predicted_s']} / {k['measured_s']}")
    print("Knee (hosts), predicted / measured: " + "; ".join(knees) + " (None: no size below 80%)")


def _run_layout(args, c, ifname: str, here: str, hosts: int, per_host: int, rows: list) -> bool:
    """One job of ``hosts`` x ``per_host`` ranks on the first hosts of cluster ``c``; appends its row."""
    t0, load0 = time.time(), os.getloadavg()[0]
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(hosts * per_host),
           "-H", ",".join(f"{a}:{per_host}" for a in c.addresses[:hosts]), "--ssh-config", c.ssh_config,
           "--network-interface", ifname, "--", "env", f"PYTHONPATH={here}", sys.executable,
           os.path.abspath(__file__), "--worker", "--bucket-mb", str(args.bucket_mb),
           "--fwd-ms", str(args.fwd_ms), "--bwd-ms", str(args.bwd_ms), "--rounds", str(args.rounds),
           "--steps", str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if "RESULT " in ln), None)
    if line is None:
        print(f"{hosts}x{per_host} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return False
    res = json.loads(line.split("RESULT ", 1)[1])
    res["clock"] = {k: v - t0 for k, v in res["clock"].items()}  # seconds since this layout began
    res["pred"] = predict(res, _rate_bits(args.rate))
    res["pred_profile"] = predict(res, _rate_bits(args.rate), calibrated=False)
    res["wall_s"], res["load"] = time.time() - t0, [load0, os.getloadavg()[0]]
    rows.append(res)
    m, fit = res["median_s"], res["link"]
    print(f"{hosts} hosts x {per_host} rank(s) ({res['wall_s']:.0f} s, load {load0:.1f} -> {res['load'][1]:.1f}): "
          f"local {m['local'] * 1e3:.1f} ms (backward {res['backward_s'] * 1e3:.1f}), + 8-byte allreduce "
          f"{m['sync'] * 1e3:.1f} ms; isolated 8-byte allreduce {res['link_samples'][0][1] * 1e3:.2f} ms; "
          f"{len(res['buckets'])} buckets; link fitted to isolated allreduces: alpha {fit['alpha_s'] * 1e6:.0f} us, "
          f"{8 / fit['beta_s'] / 1e6 if fit['beta_s'] else float('inf'):.1f} Mbit/s "
          f"(tc {_rate_bits(args.rate) / 1e6:g})", flush=True)
    print("  seconds into the layout: " + ", ".join(f"{k} {v:.1f}" for k, v in res["clock"].items()))
    for name, p in res["pred"].items():
        err = (p["predicted_s"] - p["measured_s"]) / p["measured_s"]
        print(f"  {name:>12}: predicted {p['predicted_s'] * 1e3:7.1f} ms (sync {p['sync_s'] * 1e3:.1f}, exposed "
              f"{p['exposed_s'] * 1e3:.1f}, waiting {p['wait_s'] * 1e3:.1f}), measured "
              f"{p['measured_s'] * 1e3:7.1f} ms, error {err:+.1%}", flush=True)
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="HOSTSxRANKS per host, comma separated")
    ap.add_argument("--rate", default="100mbit", help="tc tbf rate of every host's link, each direction")
    ap.add_argument("--bucket-mb", type=float, default=0.5, help="DataParallel bucket_mb (0.5: one layer a bucket)")
    ap.add_argument("--fwd-ms", type=float, default=5.0, help="device time per layer, forward")
    ap.add_argument("--bwd-ms", type=float, default=25.0, help="device time per layer, backward")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    ap.add_argument("--steps", type=int, default=4, help="steps per arm per round")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return 0
    layouts = _layouts(args.layouts)
    from phalanx.testing.cluster import IFNAME, SimCluster

    rows, start = [], time.time()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with SimCluster(hosts=max(h for h, _ in layouts), rate=args.rate, ssh=True) as c:  # a layout uses the first hosts
        for hosts, per_host in layouts:
            if not _run_layout(args, c, IFNAME, here, hosts, per_host, rows):
                return 1
    _report(rows)
    _markdown(rows)
    print(f"\nwhole check: {time.time() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
