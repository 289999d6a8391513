"""Time from each membership event to the next completed training step, in-process elastic vs group restart.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/elastic_events.py [--repeats 3] [--np 4]

A small data-parallel job (hvd.DistributedOptimizer, a commit every step) under `phalanx run`;
rank 0 logs the wall time of every completed step. One job per event and repeat:

  kill       a worker SIGKILLs itself at step K       in-process (--min-np 2 --max-np N --max-restarts 0)
  exception  a worker raises at step K                in-process, same flags
  grow       rank 0 adds a host (127.0.0.1:1) to the discovery output at step K; event = the last
             step of the old world (the commit that sees the new generation), so process start and
             `import torch` of the newcomer are not counted (they overlap training)
  shrink     rank 0 removes that host at step K; event = the last step of the old world

Peer for kill and exception: TorchElastic's group restart (`phalanx run -np N --max-restarts 1`),
the same job; grow and shrink have no peer there (TorchElastic restarts every worker for them).
Prints per event the median seconds from the event to the first step completed by the changed job
(a later generation, or the restarted group), both paths and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

WORKER = textwrap.dedent('''
    import json, os, signal, sys, time
    import torch
    import phalanx.horovod.torch as hvd
    from phalanx.horovod import elastic as el
    from phalanx.elastic import inprocess

    OUT, EVENT, AT, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    hvd.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), named_parameters=net.named_parameters())
    state = el.TorchState(net, opt.optimizer, step=0, commit_dir=OUT + "/c")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and inprocess.generation() == 0

    def log(what, **kw):
        with open(OUT + "/log.jsonl", "a") as f:
            f.write(json.dumps({"what": what, "t": time.time(), "size": hvd.size(), "gen": inprocess.generation(),
                                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **kw}) + "\\n")

    @el.run
    def train(state):
        while state.step < STEPS:
            x = torch.randn(32, 64)
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
            state.step += 1
            if hvd.rank() == 0:
                log("step", step=state.step)
            if state.step == AT and first and inprocess.generation() == 0:
                if EVENT in ("kill", "exception") and hvd.rank() == 1:
                    log("event")
                    if EVENT == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise RuntimeError("benchmark: scheduled failure")
                if EVENT in ("grow", "shrink") and hvd.rank() == 0:
                    with open(OUT + "/hosts.txt", "w") as f:
                        f.write(os.environ["BENCH_HOSTS_AFTER"])
                    while inprocess.latest_generation() <= inprocess.generation():
                        time.sleep(0.01)   # the launcher published the change (the newcomer is ready)
                    log("event")
            state.commit()

    train(state)
''')


def one(event: str, path: str, np: int, at: int, steps: int) -> float | None:
    """Run one job; seconds from the event to the next completed step (None: the job failed)."""
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(out, "w.py")
        with open(script, "w") as f:
            f.write(WORKER)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        flags = ["-np", str(np)]
        if path == "restart":
            flags += ["--max-restarts", "1"]
        elif event in ("grow", "shrink"):
            before = f"localhost:{np - 1}\n" + ("" if event == "grow" else "127.0.0.1:1\n")
            after = f"localhost:{np - 1}\n" + ("127.0.0.1:1\n" if event == "grow" else "")
            with open(os.path.join(out, "hosts.txt"), "w") as f:
                f.write(before)
            disc = os.path.join(out, "disc.sh")
            with open(disc, "w") as f:
                f.write(f"#!/bin/sh\ncat {out}/hosts.txt\n")
            os.chmod(disc, 0o755)
            env["BENCH_HOSTS_AFTER"] = after
            start_np = np - 1 if event == "grow" else np
            flags = ["-np", str(start_np), "--min-np", str(np - 1), "--max-np", str(np),
                     "--host-discovery-script", disc, "--discovery-interval", "0.2"]
        else:
            flags += ["--min-np", "2", "--max-np", str(np), "--max-restarts", "0"]
        cmd = [sys.executable, "-m", "phalanx", "run", *flags, "--timeout", "60", sys.executable, script, out,
               event, str(at), str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode != 0:
            print(f"  {event}/{path}: job failed ({proc.returncode}): {proc.stderr[-600:]}", file=sys.stderr)
            return None
        rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    ev = next(r for r in rows if r["what"] == "event")
    # the first step completed in the changed job: a later generation (in-process) or a restart
    after = [r for r in rows if r["what"] == "step" and r["t"] > ev["t"]
             and (r["gen"], r["restart"]) > (ev["gen"], ev["restart"])]
    return after[0]["t"] - ev["t"] if after else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--at", type=int, default=8, help="step of the event")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--events", default="kill,exception,grow,shrink")
    args = p.parse_args()
    print(f"{'event':<10} {'in-process s':>13} {'group restart s':>16} {'ratio':>7}   (median of {args.repeats})")
    for event in args.events.split(","):
        paths = ["inprocess", "restart"] if event in ("kill", "exception") else ["inprocess"]
        got = {path: [] for path in paths}
        for _ in range(args.repeats):
            for path in paths:  # interleaved
                t = one(event, path, args.np, args.at, args.steps)
                if t is not None:
                    got[path].append(t)
        med = {k: statistics.median(v) if v else float("nan") for k, v in got.items()}
        peer = med.get("restart")
        ratio = f"{med['inprocess'] / peer:7.3f}" if peer else "      -"
        print(f"{event:<10} {med['inprocess']:13.2f} {peer if peer else float('nan'):16.2f} {ratio}")


if __name__ == "__main__":
    main()
