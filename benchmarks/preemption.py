"""Preemption timings through ``phalanx run -np 2 --preempt-signal USR1`` (a DP MLP, plain loop).

Run::

    flock /tmp/phalanx-bench.lock python benchmarks/preemption.py [--repeats 3] [--hidden 512]
    flock /tmp/phalanx-bench.lock python benchmarks/preemption.py --vote-cost [--hidden 512]

Per repeat: start the job, wait until it trains, send SIGUSR1 to ``phalanx run`` and time
signal -> checkpoint manifest written -> ``phalanx run`` exited (status 85); then resume it
(``SLURM_RESTART_COUNT=1``) and time launch -> first resumed step done, beside a fresh launch ->
first step done. Prints medians. Wall-clock times of whole processes, seconds.

``--vote-cost``: the price of ``preempt.requested()`` in a plain loop: DP steps with and without
it, interleaved in blocks of 50, medians per step.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = r'''
import os, sys, time, torch, phalanx as px
from phalanx.checkpoint import CheckpointManager, RNGState
out, hidden = sys.argv[1], int(sys.argv[2])
px.init()
torch.manual_seed(0)
model = px.DataParallel(torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
mgr = CheckpointManager(os.path.join(out, "ckpt"))
state = {"model": model.module, "optim": opt, "rng": RNGState(), "step": 0}
with px.preemption.watch() as preempt:
    preempt.resume(mgr, state)
    first = state["step"]
    for step in range(first, 100000):
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        state["step"] = step + 1
        if step == first and px.rank() == 0:
            with open(os.path.join(out, f"first_step.{first}"), "w") as f:
                f.write(repr(time.time()))
        if preempt.requested():
            preempt.save_and_exit(mgr, state["step"], state)
'''


VOTE_WORKER = r'''
import statistics, sys, time, torch, phalanx as px
hidden = int(sys.argv[1])
px.init()
torch.manual_seed(0)
model = px.DataParallel(torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
times = {False: [], True: []}
with px.preemption.watch() as preempt:
    for block in range(20):
        vote = block % 2 == 1
        t0 = time.perf_counter()
        for _ in range(50):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            if vote:
                preempt.requested()
        times[vote].append((time.perf_counter() - t0) / 50 * 1e3)
if px.rank() == 0:
    a, b = statistics.median(times[False][1:]), statistics.median(times[True][1:])
    print(f"step without vote {a:.3f} ms, with vote {b:.3f} ms, ratio {b / a:.3f}")
'''


def vote_cost(hidden):
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "vote.py")
        with open(path, "w") as f:
            f.write(VOTE_WORKER)
        subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", sys.executable, path, str(hidden)],
                       check=True)


def _launch(out, hidden, env=None):
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--preempt-signal", "USR1",
           sys.executable, os.path.join(out, "worker.py"), out, str(hidden)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(path, proc, limit=300):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"job ended or stalled before {path}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.005)
    with open(path) as f:
        return float(f.read() or time.time())


def one(hidden):
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        with open(os.path.join(out, "worker.py"), "w") as f:
            f.write(WORKER)
        started = time.time()
        proc = _launch(out, hidden)
        rows["fresh launch -> first step"] = _wait_for(os.path.join(out, "first_step.0"), proc) - started
        time.sleep(1.0)  # let it train
        sent = time.time()
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(300)
        exited = time.time()
        assert code == 85, (code, proc.stderr.read()[-2000:])
        (ckpt,) = os.listdir(os.path.join(out, "ckpt"))
        step = int(ckpt.split("-")[-1])
        written = os.path.getmtime(os.path.join(out, "ckpt", ckpt, "manifest.json"))
        rows["signal -> checkpoint written"] = written - sent
        rows["signal -> phalanx run exited 85"] = exited - sent
        started = time.time()
        proc = _launch(out, hidden, env=dict(os.environ, SLURM_RESTART_COUNT="1"))
        rows["resume launch -> first step"] = _wait_for(os.path.join(out, f"first_step.{step}"), proc) - started
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vote-cost", action="store_true")
    args = ap.parse_args()
    if args.vote_cost:
        return vote_cost(args.hidden)
    runs = [one(args.hidden) for _ in range(args.repeats)]
    print(f"preemption timings, phalanx run -np 2, MLP 256-{args.hidden}-10, medians of {args.repeats} (s)")
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"  {key:34s} {statistics.median(values):7.2f}   (min {min(values):.2f}, max {max(values):.2f})")


if __name__ == "__main__":
    main()
