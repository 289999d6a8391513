"""Dynamic load balancing vs uniform data parallelism, one rank made exactly 2x slower.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/balance.py --repeats 5

2 ranks train a model on digits with a fixed global batch of --batch samples for
--epochs epochs, every arm on the same permutations. Rank 1 gets an injected
delay proportional to its batch: a sleep of k seconds per sample of its local
batch in forward. k is calibrated at the start of every arm, in that run's own
processes (the two vCPUs' relative speed moved by 0.80-1.13x from run to run):
both ranks time --calib-steps forward+backward passes at the uniform split on a
copy of the model, k = (2 t0 - t1) / n; a second round with rank 1 sleeping k n
first (as it will in training) corrects k the same way. The printed "slowdown"
is the factor actually achieved: compute r1 / r0 in the uniform arm.

--model picks the regime (docs/load_balancing.md, "Which jobs gain"):

  conv  (default) a small conv net on the 8x8 images: 58K parameters (0.23 MB of
        gradient per step), ~15 ms of compute per 128 samples: compute-dominated,
        the case where re-splitting the batch pays off.
  mlp   the digits MLP, hidden --hidden (1.1M parameters at 1024, 4.6 MB of gradient),
        ~12 ms of compute per 128 samples next to ~6 ms per step that does not scale
        with the split (allreduce, optimizer, launch): F-dominated, which caps any
        balancer at (F + 2 Bc) / (F + 4 Bc / 3).

--device-us T switches to simulated devices: both ranks sleep T us per sample
(rank 1: 2T) on top of the real compute (the mechanism on independent devices).

Arms, run interleaved (each repeat runs every arm once, fresh ranks each time,
the order rotated per repeat so a load trend does not favour one arm):

  uniform     phalanx DataParallel, equal split (Balancer(adjust=False): measures only)
  balanced    phalanx DataParallel + Balancer (speed-proportional split, every --every steps)
  torch DDP   DistributedDataParallel on the equal split (the peer; no compute/wait split)

Printed per arm (median over repeats): step time, samples/s over the whole run
(the balancer's convergence included), wait time per step of each rank (blocked
on the gradient allreduce), each rank's compute time per step, σ = the seed's
load standard deviation over the ranks' compute times (t_i = rank i's mean
compute per step over the second half of the run's exchanges, the steady
state), "window σ" = the mean of the σ of each exchange window (includes
step-to-step noise the balancer cannot remove), the final split and the test
accuracy; then F = the step time outside the slowest rank's compute (measured
in the uniform arm), the ideal speed-up for an exact 2x straggler with that F,
and the balanced/uniform ratios against the goals (>= 1.3x samples/s, σ reduced
>= 5x, same accuracy).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import phalanx as px
from phalanx.comm.collectives import all_gather_flat
from phalanx.demo import load_digits, make_model


def make_conv(channels: int = 32, seed: int = 0) -> nn.Module:
    """Digits as 1x8x8 images: conv(c) - conv(2c) - pool - conv(2c) - pool - linear. 58K parameters at c=32."""
    torch.manual_seed(seed)
    c = channels
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * c * 4, 10),
    )


def _net(args) -> nn.Module:
    return make_conv(args.channels) if args.model == "conv" else make_model(args.hidden)


class _Delayed(nn.Module):
    """The model plus a sleep of ``per_sample_s`` per input row in forward (the injected slowness)."""

    def __init__(self, net: nn.Module, per_sample_s: float) -> None:
        super().__init__()
        self.net, self.per_sample_s = net, per_sample_s

    def forward(self, x):
        if self.per_sample_s:
            time.sleep(self.per_sample_s * len(x))
        return self.net(x)


def _delay_in_run(net: nn.Module, x, y, steps: int) -> tuple[float, float]:
    """k for rank 1, from this run's own speeds, on a copy of the model (training starts untouched).

    Round 1: both ranks time ``steps`` forward+backward passes of ``n = len(x)`` rows (half the
    global batch) at the same time; k = (2 t0 - t1) / n. Round 2 repeats it the way the uniform
    arm runs: rank 1 sleeps k n before each pass and the ranks meet after it (a 1-element
    allreduce), so rank 0 computes partly alone, as it will; k is corrected from rank 0's time
    and rank 1's own compute the same way. Returns (k, rank 1's undelayed time over rank 0's)."""
    probe, loss_fn, n = copy.deepcopy(net), nn.CrossEntropyLoss(), len(x)
    k, first = 0.0, float("nan")
    for _ in range(2):
        px.barrier()
        times = []
        for _ in range(steps):
            if px.rank() == 1 and k:
                time.sleep(k * n)
            t1 = time.perf_counter()
            loss_fn(probe(x), y).backward()
            times.append(time.perf_counter() - t1)  # own compute (rank 1: without the sleep)
            if k:
                dist.all_reduce(torch.zeros(1))
        mine = torch.tensor([statistics.median(times[steps // 4:])], dtype=torch.float64)
        both = torch.empty(2, dtype=torch.float64)
        all_gather_flat(both, mine)
        c0, own1 = both.tolist()
        first = own1 / c0 if not k else first
        k = max((2 * c0 - own1) / n, 0.0)
    return k, first


def _train(kind: str, args) -> dict:
    rank = px.rank()
    x_train, y_train, x_test, y_test = load_digits()
    net = _net(args)
    k, speed_ratio = 0.0, float("nan")
    if args.device_us:  # simulated independent devices: T and 2T per sample
        per_sample_s = args.device_us * 1e-6 * (2 if rank == 1 else 1)
    else:
        n = args.batch // 2
        k, speed_ratio = _delay_in_run(net, x_train[:n], y_train[:n], args.calib_steps)
        per_sample_s = k if rank == 1 else 0.0
    delayed = _Delayed(net, per_sample_s)
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
           "delay_us": k * 1e6, "calib_ratio": speed_ratio}
    if kind != "ddp":
        steady = list(bal.history)[len(bal.history) // 2:]
        out["wait_ms"] = [statistics.mean(r.wait_s[i] for r in steady) * 1e3 for i in range(2)]
        out["compute_ms"] = [statistics.mean(r.compute_s[i] for r in steady) * 1e3 for i in range(2)]
        out["sigma_ms"] = px.balance.load_sigma(out["compute_ms"])  # of each rank's mean compute time
        out["window_sigma_ms"] = statistics.mean(r.sigma_s for r in steady) * 1e3  # incl. step-to-step noise
        out["sizes"] = list(bal.sizes)
        out["speed_ratio"] = statistics.mean(r.samples_per_s[0] / r.samples_per_s[1] for r in steady)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256, help="global batch")
    ap.add_argument("--model", choices=("conv", "mlp"), default="conv",
                    help="conv: compute-dominated (the default); mlp: allreduce-dominated (F caps the gain)")
    ap.add_argument("--channels", type=int, default=32, help="conv: channels of the first layer")
    ap.add_argument("--hidden", type=int, default=1024, help="mlp: hidden width")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--every", type=int, default=5, help="steps between timing exchanges")
    ap.add_argument("--calib-steps", type=int, default=20,
                    help="forward+backward passes per rank that calibrate the delay at the start of each arm")
    ap.add_argument("--device-us", type=float, default=0.0,
                    help="simulated device time per sample on rank 0 (rank 1: 2x); 0 = real compute + delay")
    args = ap.parse_args()
    if args.batch < 4 or args.batch % 2:
        ap.error(f"--batch {args.batch}: need an even global batch of at least 4 (2 ranks)")
    arms = {"uniform": "uniform", "balanced": "balanced", "torch DDP": "ddp"}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    names = list(arms)
    for i in range(args.repeats):  # interleaved: each repeat runs every arm once, order rotated
        for name in names[i % 3:] + names[:i % 3]:
            runs[name].append(px.run(_train, np=2, args=(arms[name], args), timeout=600, threads=1)[0])

    def med(name, key, i=None):
        vals = [r[key] if i is None else r[key][i] for r in runs[name] if key in r]
        return statistics.median(vals) if vals else float("nan")

    factors = [u["compute_ms"][1] / u["compute_ms"][0] for u in runs["uniform"]]
    slowdown = statistics.median(factors)
    what = (f"simulated devices {args.device_us:g}/{2 * args.device_us:g} us/sample" if args.device_us else
            f"rank 1 delayed k us/sample, k calibrated at the start of each arm (median k "
            f"{statistics.median(r['delay_us'] for rs in runs.values() for r in rs):.0f} us)")
    model = f"conv net c={args.channels}" if args.model == "conv" else f"MLP hidden {args.hidden}"
    params = sum(p.numel() for p in _net(args).parameters())
    print(f"2 ranks, {what}, {model} ({params / 1e3:.0f}K parameters), global batch {args.batch}, "
          f"{args.epochs} epochs of digits, median of {args.repeats} interleaved repeats")
    if not args.device_us:
        bal_ratio = [b["speed_ratio"] for b in runs["balanced"]]
        print("achieved slowdown of rank 1 at the uniform split (compute r1 / r0, uniform arm): "
              f"{slowdown:.2f}x (goal 2.00; per repeat {', '.join(f'{f:.2f}' for f in factors)}); "
              f"speed ratio r0/r1 in the balanced arm (other batch sizes) {statistics.median(bal_ratio):.2f}x; "
              "undelayed speed ratio r1/r0 in the calibrations: " + ", ".join(
                  f"{r['calib_ratio']:.2f}" for rs in runs.values() for r in rs))
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
    # F: the part of a step that does not scale with the split (allreduce, optimizer, launch);
    # Bc: the fast rank's compute at the uniform split. An exact 2x straggler at best gains
    # (F + 2 Bc) / (F + 4 Bc / 3) (rank 0 takes 2/3 of the batch).
    bc = med("uniform", "compute_ms", 0)
    f = med("uniform", "step_ms") - med("uniform", "compute_ms", 1)
    ideal = (f + 2 * bc) / (f + 4 * bc / 3)
    s_ = slowdown if not args.device_us else 2.0
    ideal_s = (f + s_ * bc) / (f + 2 * s_ * bc / (1 + s_))  # for the slowdown s actually achieved
    print(f"F (uniform step - slow rank's compute) = {f:.1f} ms, Bc (fast rank's uniform compute) = {bc:.1f} ms: "
          f"ideal speed-up for a 2x straggler (F + 2Bc)/(F + 4Bc/3) = {ideal:.2f}x "
          f"(for the achieved {s_:.2f}x: {ideal_s:.2f}x); "
          f"balanced step - its slowest compute = {med('balanced', 'step_ms') - max(med('balanced', 'compute_ms', i) for i in range(2)):.1f} ms")
    speed = med("balanced", "samples_per_s") / med("uniform", "samples_per_s")
    sigma = med("uniform", "sigma_ms") / med("balanced", "sigma_ms")
    wsigma = med("uniform", "window_sigma_ms") / med("balanced", "window_sigma_ms")
    vs_ddp = med("balanced", "samples_per_s") / med("torch DDP", "samples_per_s")
    dacc = med("balanced", "acc") - med("uniform", "acc")
    print(f"balanced vs uniform: {speed:.2f}x samples/s (goal >= 1.3; by median step time "
          f"{med('uniform', 'step_ms') / med('balanced', 'step_ms'):.2f}x), sigma reduced {sigma:.1f}x "
          f"(goal >= 5; window sigma {wsigma:.1f}x), accuracy {dacc:+.4f}; balanced vs torch DDP: {vs_ddp:.2f}x samples/s")
    paired = statistics.median(b["samples_per_s"] / u["samples_per_s"] for u, b in zip(runs["uniform"], runs["balanced"]))
    print(f"median of the per-repeat ratios balanced/uniform (each repeat's arms ran back to back): {paired:.2f}x samples/s")
    print("per repeat samples/s uniform/balanced/DDP: " + ", ".join(
        f"{u['samples_per_s']:.0f}/{b['samples_per_s']:.0f}/{d['samples_per_s']:.0f}"
        for u, b, d in zip(runs["uniform"], runs["balanced"], runs["torch DDP"])))


if __name__ == "__main__":
    main()
