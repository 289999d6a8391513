"""Compressed gradient allreduce vs torch DDP (plain, fp16 hook, PowerSGD hook), in one run.

    python benchmarks/compression.py                  # 2 ranks, loopback, 3 repeats
    python benchmarks/compression.py --repeats 5 --hidden 1024 --epochs 3

Each configuration trains the same MLP on digits (64 -> hidden -> hidden -> 10, one
flat gradient bucket per step) on 2 gloo ranks and reports: bytes this rank sent
per step (phalanx: counted by ``phalanx.comm.compressed.wire``; DDP: the fp32 /
fp16 / PowerSGD factor sizes a ring allreduce sends), median step time over the
repeats (configurations interleaved inside each repeat), final test accuracy.
On loopback the wire is not the bottleneck, so step-time gains are not expected
here; the byte counts are what a slow link would feel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import phalanx as px
from phalanx.comm.compressed import allreduce_compressed, wire
from phalanx.comm.compression import get_compressor

PHALANX = [
    ("none", {}), ("fp16", {}), ("int8", {}), ("int4", {}), ("sign", {"chunk": 8}), ("sign", {}),
    ("topk", {"ratio": 0.01}), ("powersgd", {"rank": 8}),
]
DDP = ["ddp", "ddp+fp16_hook", "ddp+powersgd_hook"]


def _model(hidden):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _one(config, hidden, epochs):
    from phalanx.demo import load_digits

    r, n = px.rank(), px.size()
    xtr, ytr, xte, yte = load_digits()
    model = _model(hidden)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    comp, ddp = None, None
    if isinstance(config, tuple):
        comp = get_compressor(config[0], **config[1])
    else:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024)
        if config == "ddp+fp16_hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif config == "ddp+powersgd_hook":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=8, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    net = ddp or model
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    batch, local = 64, 64 // n
    times, sent = [], []
    for epoch in range(epochs):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch))
        for step in range(len(xtr) // batch):
            idx = order[step * batch + r * local:][:local]
            px.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            if comp is not None:
                wire.reset()
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                avg = allreduce_compressed(flat, comp, name="bucket0")
                for p, g in zip(params, torch.split(avg, [p.numel() for p in params])):
                    p.grad.copy_(g.view_as(p))
                sent.append(wire.bytes_sent)
            opt.step()
            times.append(time.perf_counter() - t0)
    ring = 2 * (n - 1) / n
    if config == "ddp":
        sent = [ring * numel * 4]
    elif config == "ddp+fp16_hook":
        sent = [ring * numel * 2]
    elif config == "ddp+powersgd_hook":  # per-layer P and Q for matrices, vectors uncompressed
        total = 0
        for p in params:
            if p.dim() == 2:
                rk = min(8, *p.shape)
                total += (p.shape[0] + p.shape[1]) * rk * 4
            else:
                total += p.numel() * 4
        sent = [ring * total]
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    return {"step_s": statistics.median(times[5:]), "bytes": statistics.median(sent), "acc": acc,
            "dense": ring * numel * 4}


def _bench(hidden, epochs, repeats):
    out = {}
    configs = list(PHALANX) + DDP
    for _ in range(repeats):
        for c in configs:  # interleaved: each repeat runs every configuration once
            key = c if isinstance(c, str) else f"{c[0]}{c[1] or ''}"
            out.setdefault(key, []).append(_one(c, hidden, epochs))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    res = px.run(_bench, np=a.np, args=(a.hidden, a.epochs, a.repeats), timeout=3000)[0]
    base = statistics.median(r["step_s"] for r in res["ddp"])
    print(f"{a.np} ranks, gloo loopback, MLP hidden {a.hidden}, {a.epochs} epochs, {a.repeats} repeats (median)")
    print(f"{'config':<28}{'bytes/step':>12}{'x fewer':>9}{'step ms':>9}{'vs ddp':>8}{'test acc':>9}")
    for key, runs in res.items():
        step = statistics.median(r["step_s"] for r in runs)
        nbytes = statistics.median(r["bytes"] for r in runs)
        acc = statistics.median(r["acc"] for r in runs)
        print(f"{key:<28}{nbytes:>12.0f}{runs[0]['dense'] / nbytes:>9.1f}{step * 1e3:>9.2f}"
              f"{base / step:>8.2f}{acc:>9.4f}")


if __name__ == "__main__":
    main()
