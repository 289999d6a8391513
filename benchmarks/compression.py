"""Compressed gradient reduction (DataParallel) vs torch DDP (plain, fp16 hook, PowerSGD hook), in one run.

    python benchmarks/compression.py                             # 2 ranks, gloo loopback
    python benchmarks/compression.py --cluster 2 --rate 1gbit    # root: 2 simulated hosts, 1 rank each

Every configuration trains the same MLP on digits (64 -> hidden -> hidden -> 10; at
the default hidden 2048 that is 4.3M parameters, 17 MB of fp32 gradients per step,
one bucket) with SGD + momentum and a cosine learning-rate decay, global batch 64
(``--batch``).
phalanx runs through ``DataParallel(compression=name)`` at the registry defaults
(``name+overlap``, e.g. ``int8+overlap``: with ``overlap_optimizer=`` the SGD step runs on each
piece of the gradient as it is decoded, while later pieces are still on the wire);
the peers are torch DDP, DDP + ``fp16_compress_hook`` and DDP + ``powerSGD_hook``
(rank 4, like phalanx's default). Reported per configuration: bytes this rank
sent per step (phalanx: counted by the engine; DDP: the fp32 / fp16 / P+Q sizes a
ring allreduce sends; ``local``: no communication, the compute floor), median step time (forward + backward with its gradient
reduction + optimizer step; configurations interleaved inside every repeat),
final test accuracy; ratios vs DDP and vs both torch hooks. On loopback the wire is nearly
free; the simulated 1 Gbit/s link (``phalanx.testing.cluster``, tc tbf) is where compression
must pay off.

Why this model is bandwidth-bound: a 2048x2048 middle layer holds 96% of its 4.35M
parameters, and at a small batch the compute per parameter is a few ns (forward, backward
and the SGD step together: ``local``, 12-18 ms a step at global batch 8 on this machine)
while the fp32 gradient costs 32 ns per parameter on a 1 Gbit/s ring of two: uncompressed,
a step is ~90% communication. ``--wire-floor`` measures each payload alone on the network,
``--codec-floor`` each codec alone on one core: the best ratio a compressor can reach here is
DDP / (local + its wire time), with a free codec.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import phalanx as px

PHALANX = ["none", "fp16", "bf16", "int8", "int4", "2bit", "sign", "topk", "threshold", "powersgd"]
DDP = ["ddp", "ddp+fp16_hook", "ddp+powersgd_hook"]
FLOOR = ["local"]  # no gradient communication at all: the compute floor of a step
SETTINGS = {"threshold": {"threshold": 0.01}}  # no model-independent default (see docs/compression.md)
PSGD_RANK = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _phalanx(config: str) -> bool:
    """A phalanx configuration: a compressor name, optionally ``+overlap`` (DataParallel's
    ``overlap_optimizer``: SGD stepped on each piece of the gradient as it is decoded)."""
    name, plus, extra = config.partition("+")
    return name in PHALANX and (not plus or extra == "overlap")


def _model(hidden):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _ddp_bytes(config, params, n):
    ring = 2 * (n - 1) / n
    if config == "ddp":
        return ring * sum(p.numel() for p in params) * 4
    if config == "ddp+fp16_hook":
        return ring * sum(p.numel() for p in params) * 2
    total = 0  # powerSGD_hook: P and Q per matrix, vectors uncompressed
    for p in params:
        if p.dim() == 2:
            rk = min(PSGD_RANK, *p.shape)
            total += (p.shape[0] + p.shape[1]) * rk * 4
        else:
            total += p.numel() * 4
    return ring * total


def _one(config, hidden, epochs, skip, batch=64):
    from phalanx.comm.compression.codecs import get_compressor
    from phalanx.demo import load_digits

    wall0 = time.perf_counter()
    r, n = px.rank(), px.size()
    xtr, ytr, xte, yte = load_digits()
    net = _model(hidden)
    params = list(net.parameters())
    if config == "local":
        model = net
    elif config in DDP:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1024)
        if config == "ddp+fp16_hook":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif config == "ddp+powersgd_hook":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=PSGD_RANK,
                                                start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:  # "int8" or "int8+overlap": the optimizer stepped on each piece as it arrives
        name, _, overlap = config.partition("+")
        comp = get_compressor(name, **SETTINGS.get(name, {}))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        model = px.DataParallel(net, compression=comp, bucket_mb=1024, overlap_optimizer=opt if overlap else None)
    if config in DDP + FLOOR:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    local = batch // n
    steps = len(xtr) // batch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * steps)
    times, sent = [], []
    for epoch in range(epochs):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps):
            idx = order[step * batch + r * local:][:local]
            before = getattr(model, "bytes_sent", 0)
            px.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            sched.step()
            if _phalanx(config):
                sent.append(model.bytes_sent - before)
    if config in DDP:
        sent = [_ddp_bytes(config, params, n)]
    elif config == "local":
        sent = [0]
    else:
        model._engine.remove_hooks()
    with torch.no_grad():
        acc = (net(xte).argmax(1) == yte).float().mean().item()
    step_s = px.allreduce(torch.tensor([statistics.median(times[skip:])]), op=px.Max).item()
    return {"step_s": step_s, "bytes": statistics.median(sent[skip:] or sent), "acc": acc,
            "dense": _ddp_bytes("ddp", params, n), "wall_s": time.perf_counter() - wall0}


def _bench(hidden, epochs, repeats, configs, batch=64, wire_floor=False):
    torch.set_num_threads(1)  # one core per rank on the 2-core machine
    out = {}
    for _ in range(repeats):
        for c in configs:  # interleaved: each repeat runs every configuration once
            out.setdefault(c, []).append(_one(c, hidden, epochs, skip=3, batch=batch))
    if wire_floor:
        sizes = {c: statistics.median(r["bytes"] for r in out[c]) for c in configs if c in PHALANX}
        out["_wire"] = [_wire_floor(sizes)]
    return out


def _wire_floor(sizes: dict, repeats: int = 15) -> dict:
    """Milliseconds the payload alone takes on this network: each config's bytes per step sent
    as an allgather (2 ranks: what each rank sends is what it receives) in the pieces the
    compressed path uses (at most ``PIECE_NUMEL`` bytes each), nothing else running. Median of
    ``repeats``, the slowest rank's. PowerSGD's bytes go as one allgather here; it really sends
    them in two sequential allreduces, so its floor is a little higher than shown."""
    from phalanx.comm.collectives import all_gather_flat
    from phalanx.comm.compression.paths import PIECE_NUMEL

    n = px.size()
    res = {}
    for c, nbytes in sizes.items():
        if not nbytes:
            continue
        per_rank = int(nbytes) // max(1, n - 1)
        pieces = max(1, -(-per_rank // PIECE_NUMEL))  # ~1 byte per value for int8: PIECE_NUMEL bytes a piece
        chunk = -(-per_rank // pieces)
        bufs = [(torch.zeros(chunk, dtype=torch.uint8), torch.empty(n * chunk, dtype=torch.uint8))
                for _ in range(pieces)]
        times = []
        for _ in range(repeats + 2):
            px.barrier()
            t0 = time.perf_counter()
            works = [all_gather_flat(o, i, async_op=True) for i, o in bufs]
            for w in works:
                w.wait()
            times.append(time.perf_counter() - t0)
        res[c] = px.allreduce(torch.tensor([statistics.median(times[2:])]), op=px.Max).item() * 1e3
    return res


def _codec_floor(configs, numel, repeats=15) -> dict:
    """CPU cost of each phalanx codec on ``numel`` values, one thread, no communication: the
    error-feedback add + compress of this rank's gradient, and decoding both ranks' payloads
    into one buffer (what the 2-rank allgather path does). Median ms of ``repeats``."""
    from phalanx.comm.compression.abilities import codec_of
    from phalanx.comm.compression.codecs import get_compressor
    from phalanx.comm.compression.error_feedback import compress_residual
    from phalanx.comm.compression.paths import decode_into, pieces

    torch.set_num_threads(1)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    out_buf = torch.empty(numel)
    floor = {}
    for c in configs:
        if c not in PHALANX or c in ("none", "fp16", "bf16", "powersgd"):
            continue
        comp = get_compressor(c, **SETTINGS.get(c, {}))
        feedback, inner = codec_of(comp)
        enc, dec = [], []
        cuts = pieces(inner, numel, None)  # as allreduce_compressed cuts it
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            res = feedback.accumulate("g", grad)
            sent = [(compress_residual(inner, res[a:b]), a, b) for a, b in cuts]
            t1 = time.perf_counter()
            for (payload, ctx), a, b in sent:
                for r in range(2):
                    decode_into(inner, payload, ctx, out_buf[a:b], 0.5, add=r > 0)
            t2 = time.perf_counter()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
        floor[c] = {"compress_ms": statistics.median(enc[2:]) * 1e3, "decode_ms": statistics.median(dec[2:]) * 1e3,
                    "pieces": len(cuts)}
    return floor


def _rate_bytes_per_s(rate: str) -> float:
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise SystemExit(f"--rate {rate!r}: write it as tc does, e.g. 1gbit, 100mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8


def _on_cluster(args) -> dict:
    import subprocess

    from phalanx.testing.cluster import IFNAME, SimCluster

    with SimCluster(hosts=args.cluster, rate=args.rate, ssh=True) as c:
        cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(args.cluster), "-H", c.host_spec(1),
               "--ssh-config", c.ssh_config, "--network-interface", IFNAME, "--", sys.executable,
               "-m", "benchmarks.compression", "--worker", "--hidden", str(args.hidden), "--epochs", str(args.epochs),
               "--repeats", str(args.repeats), "--configs", ",".join(args.configs), "--batch", str(args.batch)]
        if args.wire_floor:
            cmd.append("--wire-floor")
        # run as a module from the repository root: the workers find phalanx (and this file) on
        # their cwd even where phalanx is not installed (ssh does not forward PYTHONPATH)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if "RESULT " in ln), None)
    if line is None:
        raise SystemExit(f"cluster run failed ({proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return json.loads(line.split("RESULT ", 1)[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="global batch (smaller: more bandwidth-bound)")
    ap.add_argument("--configs", default=",".join(PHALANX + DDP + FLOOR), help="comma-separated subset")
    ap.add_argument("--cluster", type=int, default=0, help="simulated hosts (root), one rank each")
    ap.add_argument("--rate", default="1gbit", help="simulated link rate")
    ap.add_argument("--codec-floor", action="store_true",
                    help="also time each codec alone (one thread, no network) and print the best step ratio "
                         "vs DDP it allows: DDP step / (local step + codec ms + payload bytes / link rate)")
    ap.add_argument("--wire-floor", action="store_true",
                    help="also time each compressed config's bytes per step alone on the network (an allgather "
                         "in the same pieces) and print the best step ratio vs DDP a free codec would allow: "
                         "DDP step / (local step + that wire time)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.configs = [c for c in a.configs.split(",") if c]
    unknown = [c for c in a.configs if c not in DDP + FLOOR and not _phalanx(c)]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {PHALANX + DDP + FLOOR} (phalanx ones also "
                         "with '+overlap', e.g. int8+overlap)")
    if a.worker:  # under `phalanx run` on the simulated cluster
        px.init()
        res = _bench(a.hidden, a.epochs, a.repeats, a.configs, a.batch, a.wire_floor)
        if px.rank() == 0:
            print("RESULT", json.dumps(res), flush=True)
        px.shutdown()
        return
    if a.cluster:
        res = _on_cluster(a)
        where = f"{a.cluster} simulated hosts, {a.rate} links, 1 rank each"
    else:
        res = px.run(_bench, np=a.np, args=(a.hidden, a.epochs, a.repeats, a.configs, a.batch, a.wire_floor),
                     timeout=3600)[0]
        where = f"{a.np} ranks, gloo loopback"
    wire = res.pop("_wire", [{}])[0]
    base_key = "ddp" if "ddp" in res else next(iter(res))
    med = {k: statistics.median(r["step_s"] for r in runs) * 1e3 for k, runs in res.items()}
    peers = [k for k in ("ddp+fp16_hook", "ddp+powersgd_hook") if k in med and k != base_key]
    print(f"{where}, MLP hidden {a.hidden}, global batch {a.batch}, {a.epochs} epochs, "
          f"median of {a.repeats} interleaved repeats")
    print(f"{'config':<20}{'bytes/step':>12}{'x fewer':>9}{'step ms':>10}{'vs ' + base_key:>10}"
          + "".join(f"{'vs ' + k.split('+')[1].replace('_hook', ' hook').replace('powersgd', 'psgd'):>14}"
                    for k in peers) + f"{'test acc':>10}")
    for key, runs in res.items():
        nbytes = statistics.median(r["bytes"] for r in runs)
        acc = statistics.median(r["acc"] for r in runs)
        fewer = f"{runs[0]['dense'] / nbytes:>9.1f}" if nbytes else f"{'-':>9}"
        print(f"{key:<20}{nbytes:>12.0f}{fewer}{med[key]:>10.2f}{med[base_key] / med[key]:>9.2f}x"
              + "".join(f"{med[k] / med[key]:>13.2f}x" for k in peers)
              + f"{acc:>10.4f}   (wall {statistics.median(r['wall_s'] for r in runs):.0f} s)")
    if wire:
        print("\npayload alone on the network (allgather of the bytes per step in the same pieces, median of 15):")
        print(f"{'config':<12}{'wire ms':>9}{'bound vs ddp':>14}   (bound = ddp / (local + wire): a free codec)")
        for c, ms in wire.items():
            bound = f"{med['ddp'] / (med['local'] + ms):>13.2f}x" if "ddp" in med and "local" in med else ""
            print(f"{c:<12}{ms:>9.2f}{bound}")
    if a.codec_floor:
        numel = sum(p.numel() for p in _model(a.hidden).parameters())
        floor = _codec_floor(a.configs, numel)
        link = _rate_bytes_per_s(a.rate) if a.cluster else None
        print(f"\ncodec alone, one thread, {numel} values in the pieces the allgather path uses "
              "(error feedback + compress; decode of 2 payloads)")
        print(f"{'codec':<12}{'compress ms':>12}{'decode ms':>11}{'ns/value':>10}{'wire ms':>9}{'bound vs ddp':>14}")
        for c, f in floor.items():
            codec = f["compress_ms"] + f["decode_ms"]
            line = f"{c:<12}{f['compress_ms']:>12.2f}{f['decode_ms']:>11.2f}{codec * 1e6 / numel:>10.2f}"
            if link and c in res and "ddp" in med and "local" in med:
                wire_ms = statistics.median(r["bytes"] for r in res[c]) / link * 1e3
                bound = med["ddp"] / (med["local"] + codec + wire_ms)
                line += f"{wire_ms:>9.2f}{bound:>13.2f}x"
            print(line)
        if link and "ddp" in med and "local" in med:
            print(f"(bound = ddp {med['ddp']:.1f} ms / (local {med['local']:.1f} ms + codec + wire at {a.rate}); "
                  f"with a free codec the best any compressor can do is {med['ddp'] / med['local']:.2f}x)")


if __name__ == "__main__":
    main()
