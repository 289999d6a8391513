"""Dynamic load balancing vs uniform data parallelism, one rank made 2x slower.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/balance.py --repeats 3

2 ranks train the digits MLP (hidden --hidden) with a fixed global batch of
--batch samples for --epochs epochs, every arm on the same permutations. Rank 1
gets an injected delay proportional to its batch: a sleep of k seconds per
sample, where k is one sample's forward+backward time at the uniform local
batch on one thread, measured here before each repeat and used by all arms of
that repeat (so at the uniform split rank 1 takes about 2x as long as rank 0;
the load on a shared machine moves this, and the printed "slowdown" is the
ratio actually measured in the uniform arm).

--device-us T switches to simulated devices: both ranks sleep T us per sample
(rank 1: 2T) on top of the real MLP compute. Use it to see the balancing
mechanism on independent devices: the 2 CPU ranks of a small shared machine
contend for the CPU, so with real compute a rank runs faster while the other
sleeps (the uniform arm) than when both compute at once (the balanced arm).

Arms, run interleaved (each repeat runs every arm once, fresh ranks each time,
the order rotated per repeat so a load trend does not favour one arm):

  uniform     phalanx DataParallel, equal split (Balancer(adjust=False): measures only)
  balanced    phalanx DataParallel + Balancer (speed-proportional split, every --every steps)
  torch DDP   DistributedDataParallel on the equal split (the peer; no compute/wait split)

Printed per arm (median over repeats): step time, samples/s, wait time per step
of each rank (time blocked on the gradient allreduce), each rank's compute time
per step, σ = the seed's load standard deviation over the ranks' compute times
(t_i = rank i's mean compute per step over the second half of the run's
exchanges, the steady state), "window σ" = the mean of the σ of each exchange
window (includes step-to-step noise the balancer cannot remove), the final split
and the test accuracy; then the balanced/uniform ratios against the goals (>= 1.3x samples/s,
σ reduced >= 5x, same accuracy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import phalanx as px
from phalanx.demo import load_digits, make_model


class _Delayed(nn.Module):
    """The model plus a sleep of ``per_sample_s`` per input row in forward (the injected slowness)."""

    def __init__(self, net: nn.Module, per_sample_s: float) -> None:
        super().__init__()
        self.net, self.per_sample_s = net, per_sample_s

    def forward(self, x):
        if self.per_sample_s:
            time.sleep(self.per_sample_s * len(x))
        return self.net(x)


def _calibrate(hidden: int, rows: int, reps: int = 40) -> float:
    """Seconds of forward+backward per sample at ``rows`` rows, one thread (as the ranks run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    net, loss_fn = make_model(hidden), nn.CrossEntropyLoss()
    x, y = torch.randn(rows, 64), torch.randint(0, 10, (rows,))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loss_fn(net(x), y).backward()
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return statistics.median(times[5:]) / rows


def _arm(kind: str, args, per_sample_s: float) -> dict:
    rank = px.rank()
    x_train, y_train, x_test, y_test = load_digits()
    calibrated = per_sample_s
    if args.device_us:  # simulated independent devices: T and 2T per sample
        per_sample_s = args.device_us * 1e-6 * (2 if rank == 1 else 1)
    elif rank == 0:
        per_sample_s = 0.0
    delayed = _Delayed(make_model(args.hidden), per_sample_s)
    bal = px.balance.Balancer(args.batch, every=args.every, adjust=kind == "balanced")
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(delayed)
    else:
        model = px.DataParallel(delayed, balance=bal)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    sampler = px.balance.BalancedSampler(len(x_train), bal, shuffle=True, seed=0)
    px.barrier()
    start = time.perf_counter()
    ends, samples = [], 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for idx in sampler:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
            ends.append(time.perf_counter())
            samples += len(idx)
    total = px.allreduce(torch.tensor([float(samples)]), op=px.Sum).item()
    wall = time.perf_counter() - start
    steps = [b - a for a, b in zip([start] + ends, ends)]
    with torch.no_grad():
        acc = (delayed.net(x_test).argmax(1) == y_test).float().mean().item()
    out = {"samples_per_s": total / wall, "step_ms": statistics.median(steps) * 1e3, "acc": acc,
           "delay_us": calibrated * 1e6}
    if kind != "ddp":
        steady = list(bal.history)[len(bal.history) // 2:]
        out["wait_ms"] = [statistics.mean(r.wait_s[i] for r in steady) * 1e3 for i in range(2)]
        out["compute_ms"] = [statistics.mean(r.compute_s[i] for r in steady) * 1e3 for i in range(2)]
        out["sigma_ms"] = px.balance.load_sigma(out["compute_ms"])  # of each rank's mean compute time
        out["window_sigma_ms"] = statistics.mean(r.sigma_s for r in steady) * 1e3  # incl. step-to-step noise
        out["sizes"] = list(bal.sizes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256, help="global batch")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--every", type=int, default=5, help="steps between timing exchanges")
    ap.add_argument("--device-us", type=float, default=0.0,
                    help="simulated device time per sample on rank 0 (rank 1: 2x); 0 = real compute + delay")
    args = ap.parse_args()
    arms = {"uniform": "uniform", "balanced": "balanced", "torch DDP": "ddp"}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    names = list(arms)
    for i in range(args.repeats):  # interleaved: each repeat runs every arm once, order rotated
        per_sample_s = _calibrate(args.hidden, args.batch // 2)
        for name in names[i % 3:] + names[:i % 3]:
            runs[name].append(px.run(_arm, np=2, args=(arms[name], args, per_sample_s), timeout=600,
                                     threads=1)[0])

    def med(name, key, i=None):
        vals = [r[key] if i is None else r[key][i] for r in runs[name] if key in r]
        return statistics.median(vals) if vals else float("nan")

    slowdown = med("uniform", "compute_ms", 1) / med("uniform", "compute_ms", 0)
    what = (f"simulated devices {args.device_us:g}/{2 * args.device_us:g} us/sample" if args.device_us else
            f"rank 1 delayed {med('uniform', 'delay_us'):.0f} us/sample")
    print(f"2 ranks, {what} (median; measured slowdown at the "
          f"uniform split {slowdown:.2f}x), MLP hidden {args.hidden}, "
          f"global batch {args.batch}, {args.epochs} epochs of digits, median of {args.repeats} interleaved repeats")
    print(f"{'arm':<11}{'step ms':>9}{'samples/s':>11}{'wait ms r0/r1':>16}{'compute ms r0/r1':>19}"
          f"{'sigma ms':>10}{'window σ':>10}{'sizes':>11}{'test acc':>10}")
    for name in arms:
        wait = f"{med(name, 'wait_ms', 0):.1f}/{med(name, 'wait_ms', 1):.1f}" if name != "torch DDP" else "-"
        comp = f"{med(name, 'compute_ms', 0):.1f}/{med(name, 'compute_ms', 1):.1f}" if name != "torch DDP" else "-"
        sigma = f"{med(name, 'sigma_ms'):.2f}" if name != "torch DDP" else "-"
        wsigma = f"{med(name, 'window_sigma_ms'):.2f}" if name != "torch DDP" else "-"
        sizes = "/".join(map(str, runs[name][-1].get("sizes", []))) or "-"
        print(f"{name:<11}{med(name, 'step_ms'):>9.1f}{med(name, 'samples_per_s'):>11.0f}{wait:>16}{comp:>19}"
              f"{sigma:>10}{wsigma:>10}{sizes:>11}{med(name, 'acc'):>10.4f}")
    speed = med("balanced", "samples_per_s") / med("uniform", "samples_per_s")
    sigma = med("uniform", "sigma_ms") / med("balanced", "sigma_ms")
    wsigma = med("uniform", "window_sigma_ms") / med("balanced", "window_sigma_ms")
    vs_ddp = med("balanced", "samples_per_s") / med("torch DDP", "samples_per_s")
    dacc = med("balanced", "acc") - med("uniform", "acc")
    print(f"balanced vs uniform: {speed:.2f}x samples/s (goal >= 1.3), sigma reduced {sigma:.1f}x (goal >= 5; window sigma {wsigma:.1f}x), "
          f"accuracy {dacc:+.4f}; balanced vs torch DDP: {vs_ddp:.2f}x samples/s")
    print("per repeat samples/s uniform/balanced/DDP: " + ", ".join(
        f"{u['samples_per_s']:.0f}/{b['samples_per_s']:.0f}/{d['samples_per_s']:.0f}"
        for u, b, d in zip(runs["uniform"], runs["balanced"], runs["torch DDP"])))


if __name__ == "__main__":
    main()
