"""Checkpoint speed vs torch.distributed.checkpoint (DCP), and recovery time after a worker kill.

Run:  python benchmarks/checkpoint.py [--mb 64] [--repeats 3] [--np 2] [--recovery-repeats 2]
      python benchmarks/checkpoint.py --replicated --np 4 [--mb 64] [--repeats 3]

Part 0 (``--replicated``, only this part): a data-parallel training state, the same on every
rank (a model of --mb MiB of fp32 parameters + its Adam state, 3x --mb in all) plus each rank's
own RNG state, saved by phalanx and by DCP (fsync on both sides), interleaved: bytes on disk
per save (everything under the checkpoint directory) and sync save time (median, slowest rank).
Both write replicated tensors once; before phalanx wrote every rank's full copy.

Part 1 (np ranks, each holding --mb MiB of distinct fp32 tensors, written to a local disk
directory with fsync on both sides) interleaves phalanx and DCP each repeat and reports medians:
  * sync save MiB/s       phalanx.checkpoint.save           vs dcp.save
  * load MiB/s            phalanx.checkpoint.load           vs dcp.load
  * blocked by async save phalanx save(async_=True) return  vs dcp.async_save return
    (the time the training loop is stopped; the write finishes in the background)
Part 2: a 4-worker training job whose rank 1 SIGKILLs itself at step 12 (commit every 5 steps);
recovery = time from the kill to the next completed step, by both paths, interleaved per repeat:
  * group restart: `phalanx run -np 4 --max-restarts 1` (TorchElastic stops every worker and starts
    a new group), split into: agent notices, stops the group, re-rendezvous, spawns (until the new
    rank 0 runs Python) -> import torch and phalanx -> px.init (waits for all 4 ranks) -> build model
    and optimizer (the first torch optimizer imports torch._dynamo) -> restore the commit + sync ->
    first step;
  * in-process: `phalanx run -np 4 --min-np 2 --max-np 4 --max-restarts 0` (the 3 survivors keep
    their processes; no replacement), split into: error seen, group left, re-formed, commit restored
    from memory and synced (kill -> train_fn called again) -> first step.
"""

# ruff: noqa: E402  (the process start time is taken before the imports)
from __future__ import annotations

import time

_BOOT = time.time()  # when this process started running Python (recovery breakdown); before torch

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

import phalanx as px
import phalanx.checkpoint as ckpt


def _state(mb: int, rank: int) -> dict:
    n = mb * (1 << 20) // 4 // 16
    g = torch.Generator().manual_seed(rank)
    # distinct keys per rank: DCP would otherwise de-duplicate them as replicated
    return {f"r{rank}.layer{i}": torch.randn(n, generator=g) for i in range(16)}


def _bench_rank(mb: int, repeats: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    r = px.rank()
    state = _state(mb, r)
    out = {k: [] for k in ("px_save", "dcp_save", "px_load", "dcp_load", "px_block", "dcp_block",
                           "px_async_total", "dcp_async_total")}

    def timed(fn):
        px.barrier()
        t0 = time.perf_counter()
        fn()
        px.barrier()
        return time.perf_counter() - t0

    for i in range(repeats):
        for who in (("px", "dcp") if i % 2 == 0 else ("dcp", "px")):  # interleave; alternate who goes first
            path = os.path.join(root, f"{who}-sync-{i}")
            if who == "px":
                out["px_save"].append(timed(lambda p=path: ckpt.save(p, state)))
                target = {k: torch.empty_like(v) for k, v in state.items()}
                out["px_load"].append(timed(lambda p=path, t=target: ckpt.load(p, t)))
            else:
                out["dcp_save"].append(timed(lambda p=path: dcp.save(state, checkpoint_id=p)))
                target = {k: torch.empty_like(v) for k, v in state.items()}
                out["dcp_load"].append(timed(lambda p=path, t=target: dcp.load(t, checkpoint_id=p)))
            assert all(torch.equal(target[k], state[k]) for k in state)
            apath = os.path.join(root, f"{who}-async-{i}")
            px.barrier()
            t0 = time.perf_counter()
            if who == "px":
                ckpt.save(apath, state, async_=True)
                out["px_block"].append(time.perf_counter() - t0)
                ckpt.wait()
                out["px_async_total"].append(time.perf_counter() - t0)
            else:
                fut = dcp.async_save(state, checkpoint_id=apath)
                out["dcp_block"].append(time.perf_counter() - t0)
                fut.result()
                out["dcp_async_total"].append(time.perf_counter() - t0)
            px.barrier()
            if r == 0:
                for p in (path, apath):
                    shutil.rmtree(p, ignore_errors=True)
    return out


# ---------------------------------------------------------------- part 0: replicated data-parallel state


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _replicated_rank(mb: int, repeats: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    n = mb * (1 << 20) // 4 // 16
    torch.manual_seed(0)  # the same model on every rank, as data parallelism keeps it
    model = torch.nn.Sequential(*[torch.nn.Linear(n // 64, 64, bias=False) for _ in range(16)])
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    px_state = {"model": model, "optim": opt, "rng": ckpt.RNGState()}
    # DCP wants flat tensors by name (no per-rank RNG: DCP would dedupe it as replicated)
    dcp_state = {"model": model.state_dict(), "optim": opt.state_dict()}
    out = {"px_save": [], "dcp_save": [], "px_bytes": [], "dcp_bytes": []}
    for i in range(repeats):
        for who in (("px", "dcp") if i % 2 == 0 else ("dcp", "px")):
            path = os.path.join(root, f"{who}-rep-{i}")
            px.barrier()
            t0 = time.perf_counter()
            if who == "px":
                ckpt.save(path, px_state)
            else:
                dcp.save(dcp_state, checkpoint_id=path)
            px.barrier()
            out[f"{who}_save"].append(time.perf_counter() - t0)
            out[f"{who}_bytes"].append(_disk_bytes(path) if px.rank() == 0 else 0)
            px.barrier()
            if px.rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
    return out


def _replicated_part(args) -> None:
    root = args.dir or tempfile.mkdtemp(prefix="phalanx-ckpt-bench-", dir="/tmp")
    try:
        results = px.run(_replicated_rank, np=args.np, args=(args.mb, args.repeats, root), timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save = {w: statistics.median(max(r[f"{w}_save"][i] for r in results) for i in range(args.repeats))
            for w in ("px", "dcp")}
    disk = {w: statistics.median(results[0][f"{w}_bytes"]) / 2**20 for w in ("px", "dcp")}
    print(f"torch {torch.__version__}; {args.np} ranks, replicated data-parallel state: model {args.mb} MiB fp32 "
          f"+ Adam ({3 * args.mb} MiB per rank) + per-rank RNG; median of {args.repeats} interleaved repeats")
    print(f"{'metric':32s} {'phalanx':>10s} {'DCP':>10s} {'phalanx/DCP':>12s}")
    for name, a, b in (("bytes on disk per save (MiB)", disk["px"], disk["dcp"]),
                       ("sync save (ms)", 1e3 * save["px"], 1e3 * save["dcp"])):
        print(f"{name:32s} {a:10.1f} {b:10.1f} {a / b:12.2f}")


# ---------------------------------------------------------------- recovery worker (runs under phalanx run)

KILL_STEP, COMMIT_EVERY, STEPS = 12, 5, 20


def _recovery_worker(out: str) -> None:
    from phalanx import elastic

    imported = time.time()
    px.init()
    inited = time.time()
    r = px.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # the first optimizer imports torch._dynamo
    built = time.time()
    state = elastic.TorchState(model, opt, step=0, commit_dir=os.path.join(out, "commits"))
    restart = elastic.restart_count()

    def event(what: str) -> None:
        with open(os.path.join(out, "events.txt"), "a") as f:
            f.write(f"{what} {state.step} {restart} {time.time():.4f}\n")

    if r == 0 and restart == 1:
        with open(os.path.join(out, "events.txt"), "a") as f:
            f.write(f"boot {state.step} {restart} {_BOOT:.4f}\nimported {state.step} {restart} {imported:.4f}\n"
                    f"inited {state.step} {restart} {inited:.4f}\nbuilt {state.step} {restart} {built:.4f}\n")

    from phalanx.elastic import inprocess

    @elastic.run
    def train(state):
        nonlocal restart
        if inprocess.active():
            restart = inprocess.generation()  # the in-process path: same process, next generation
        r = px.rank()
        if r == 0:
            event("resumed")
        while state.step < STEPS:
            x = torch.randn(32, 64)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                px.allreduce(p.grad, op=px.Average, inplace=True)
            opt.step()
            state.step += 1
            if restart == 0 and r == 1 and state.step == KILL_STEP:
                event("kill")
                os.kill(os.getpid(), 9)
            if state.step % COMMIT_EVERY == 0:
                state.commit()
            if r == 0:
                event("done")

    train(state)


def _recovery_once(path: str = "restart") -> tuple[float, int, dict]:
    out = tempfile.mkdtemp(prefix="phalanx-recovery-")
    try:
        flags = ["--max-restarts", "1"] if path == "restart" else ["--min-np", "2", "--max-np", "4",
                                                                   "--max-restarts", "0"]
        cmd = [sys.executable, "-m", "phalanx", "run", "-np", "4", *flags,
               sys.executable, os.path.abspath(__file__), "--recovery-worker", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"recovery run failed:\n{proc.stderr[-2000:]}")
        events = [line.split() for line in open(os.path.join(out, "events.txt"))]
        kill_t = next(float(e[3]) for e in events if e[0] == "kill")
        after = [e for e in events if e[0] == "done" and int(e[2]) == 1]
        lost = KILL_STEP - (int(after[0][1]) - 1)
        if path == "inprocess":
            resumed = next(float(e[3]) for e in events if e[0] == "resumed" and int(e[2]) == 1)
            phases = {"error, leave, re-form, restore+sync": resumed - kill_t,
                      "first step": float(after[0][3]) - resumed}
            return float(after[0][3]) - kill_t, lost, phases
        at = {e[0]: float(e[3]) for e in events if int(e[2]) == 1 and e[0] in ("boot", "imported", "inited", "built", "resumed")}
        phases = {"agent stop+rendezvous+spawn": at["boot"] - kill_t, "import torch+phalanx": at["imported"] - at["boot"],
                  "init (all 4 ranks)": at["inited"] - at["imported"],
                  "model+optimizer (imports torch._dynamo)": at["built"] - at["inited"],
                  "restore+sync": at["resumed"] - at["built"],
                  "first step": float(after[0][3]) - at["resumed"]}
        return float(after[0][3]) - kill_t, lost, phases
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _io_part(args) -> None:
    root = args.dir or tempfile.mkdtemp(prefix="phalanx-ckpt-bench-", dir="/tmp")
    try:
        results = px.run(_bench_rank, np=args.np, args=(args.mb, args.repeats, root), timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # a step is as slow as its slowest rank: take the max over ranks per repeat, then the median
    med = {k: statistics.median(max(r[k][i] for r in results) for i in range(args.repeats)) for k in results[0]}
    total_mib = args.mb * args.np
    rows = [
        ("sync save (MiB/s)", total_mib / med["px_save"], total_mib / med["dcp_save"]),
        ("load (MiB/s)", total_mib / med["px_load"], total_mib / med["dcp_load"]),
        ("blocked by async save (ms)", 1e3 * med["px_block"], 1e3 * med["dcp_block"]),
        ("async save until on disk (ms)", 1e3 * med["px_async_total"], 1e3 * med["dcp_async_total"]),
    ]
    print(f"torch {torch.__version__}; {args.np} ranks x {args.mb} MiB fp32; median of {args.repeats} "
          f"interleaved repeats; format {ckpt.io.tensor_format()}")
    print(f"{'metric':32s} {'phalanx':>10s} {'DCP':>10s} {'phalanx/DCP':>12s}")
    for name, a, b in rows:
        print(f"{name:32s} {a:10.1f} {b:10.1f} {a / b:12.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="MiB of state per rank")
    ap.add_argument("--repeats", type=int, default=3, help="part 1 repeats (0: skip part 1)")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--recovery-repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on local disk)")
    ap.add_argument("--recovery-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--replicated", action="store_true", help="only part 0: replicated state, bytes on disk")
    args = ap.parse_args()
    if args.recovery_worker:
        return _recovery_worker(args.recovery_worker)
    if args.replicated:
        return _replicated_part(args)

    if args.repeats:
        _io_part(args)
    if args.recovery_repeats:
        runs = {"restart": [], "inprocess": []}
        for _ in range(args.recovery_repeats):  # interleaved: both paths see the same machine state
            for path in runs:
                runs[path].append(_recovery_once(path))
        med = {}
        for path, rec in runs.items():
            times = [t for t, _, _ in rec]
            med[path] = statistics.median(times)
            name = {"restart": "group restart (TorchElastic)", "inprocess": "in-process (survivors kept)"}[path]
            print(f"recovery after SIGKILL of 1 of 4 workers, {name} (kill -> next completed step): median "
                  f"{med[path]:.2f} s over {len(times)} runs {[round(t, 2) for t in times]}; "
                  f"steps lost {[s for _, s, _ in rec]} (commit every {COMMIT_EVERY})")
            print("  median split: " + ", ".join(f"{k} {statistics.median(p[k] for _, _, p in rec):.2f} s"
                                                 for k in rec[0][2]))
        print(f"recovery in-process / group restart: {med['inprocess'] / med['restart']:.3f} "
              f"({med['restart'] / med['inprocess']:.1f}x faster)")

if __name__ == "__main__":
    main()
