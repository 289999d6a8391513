"""ZeRO stages vs torch's peers, same model, one run: peak memory per rank and samples/s.

Run:  python benchmarks/zero.py [--np 2] [--layers 8] [--width 1024] [--batch 64] [--steps 8] [--repeats 3]
                                 [--configs ddp,phalanx-stage2]   (a subset; default all)
      MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/zero.py ...   (RSS close to live bytes, see below)

Peers: stage 1 vs DDP + ``ZeroRedundancyOptimizer``; stage 3 vs FSDP2 ``fully_shard``
(each Linear, then the root); stage 2 and plain DDP + Adam are shown for scale.
Every configuration runs in fresh ranks (CPU, gloo), configurations interleaved
within each repeat; medians are reported. "peak" is the rise of the process's
peak resident set over its resident set just before the model was built
(max over ranks), so it includes activations, communication buffers and
allocator slack. glibc's default malloc keeps freed multi-MB blocks in its
heaps (its mmap threshold grows after each large free), so peak RSS also
depends on each config's allocation history; a fixed ``MALLOC_MMAP_THRESHOLD_``
returns large blocks at once and makes RSS follow live bytes. "model bytes"
is ``memory_report``'s params + grads + optimizer state (phalanx only).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

import phalanx as px


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _model(layers, width):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


def _bench(config, layers, width, batch, steps):
    import torch.distributed as dist

    # Connections and gloo's threads are set up by the first collectives; pay that before
    # the baseline so "peak" is what the strategy itself adds (the same for every config).
    dist.barrier()
    dist.all_gather_object([None] * dist.get_world_size(), config)
    dist.broadcast(torch.zeros(4), src=0)
    base = _rss()
    model = _model(layers, width)
    report = None
    if config == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    elif config == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
    elif config == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        stage = int(config[-1])
        model, opt = px.zero(model, torch.optim.Adam(model.parameters(), lr=1e-4), stage=stage)
    g = torch.Generator().manual_seed(px.rank())
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(2):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    dt = time.perf_counter() - t0
    if config.startswith("phalanx"):
        r = px.memory_report(opt)
        report = r["params"] + r["grads"] + r["optimizer_state"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"samples_s": batch * px.size() * steps / dt, "peak": peak, "model_bytes": report}


CONFIGS = ["ddp", "torch-zero1", "phalanx-stage1", "phalanx-stage2", "torch-fsdp2", "phalanx-stage3"]
PEER = {"phalanx-stage1": "torch-zero1", "phalanx-stage3": "torch-fsdp2"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list, a subset of " + ",".join(CONFIGS))
    a = ap.parse_args()
    configs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {CONFIGS}")
    psi = a.layers * (a.width * a.width + a.width)
    print(f"model: {a.layers} x Linear({a.width},{a.width}), {psi / 1e6:.1f}M params, Adam fp32, np={a.np}, "
          f"global batch {a.batch * a.np}, {a.steps} timed steps, {a.repeats} repeats (interleaved), "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset (glibc default)')}")
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(a.repeats):
        order = configs if rep % 2 == 0 else configs[::-1]
        for c in order:
            res = px.run(_bench, np=a.np, args=(c, a.layers, a.width, a.batch, a.steps), timeout=600)
            runs[c].append({"samples_s": statistics.mean(r["samples_s"] for r in res),
                            "peak": max(r["peak"] for r in res), "model_bytes": res[0]["model_bytes"]})
    med = {c: {k: statistics.median(r[k] for r in runs[c]) if runs[c][0][k] is not None else None
               for k in ("samples_s", "peak", "model_bytes")} for c in configs}
    print("\n| config | samples/s | peak MiB/rank | model bytes MiB/rank | vs peer (mem, speed) |")
    print("|---|---|---|---|---|")
    for c in configs:
        m = med[c]
        mb = f"{m['model_bytes'] / 2**20:.1f}" if m["model_bytes"] is not None else "-"
        vs = ""
        if PEER.get(c) in med:
            p = med[PEER[c]]
            vs = f"{m['peak'] / p['peak']:.2f}x mem, {m['samples_s'] / p['samples_s']:.2f}x speed vs {PEER[c]}"
        print(f"| {c} | {m['samples_s']:.0f} | {m['peak'] / 2**20:.0f} | {mb} | {vs} |")


if __name__ == "__main__":
    main()
