"""Checkpoint speed vs torch.distributed.checkpoint (DCP), and recovery time after a worker kill.

Run:  python benchmarks/checkpoint.py [--mb 64] [--repeats 7] [--async-samples 3] [--nps 2,4] [--kind both]
                                      [--json out.json]
      python benchmarks/checkpoint.py --repeats 0 --recovery-repeats 3      (part 2 only)

Part 1, the matrix (one run): the training state of a model of --mb MiB fp32 + its Adam state
(3x --mb MiB), held two ways: replicated (every rank holds all of it, data parallel; phalanx also
saves each rank's RNG state) and sharded (each rank holds 1/np of every tensor: phalanx Shards,
DCP tensors under per-rank names), at each world size of --nps. Per cell group: a warm-up round
(both sides allocate their staging memory; its async blocked times are printed apart, not
counted), then --repeats repeats; in each, every operation is run by phalanx and DCP back to back
(who goes first alternates per repeat), so a pair sees the same machine state: a sync save, a
load into fresh objects (DCP: dcp.load into state dicts, then load_state_dict, its documented
flow; values checked equal), and --async-samples async saves per side, alternating, each waited
for (time the caller is blocked; time until the checkpoint is durable on every rank; the repeat's
figure is the median of its samples: the blocked time is short and noisy). fsync on both sides,
local disk, one directory. Time = slowest rank per repeat; the verdict uses the paired ratio
phalanx/DCP per repeat: its median and a distribution-free 95% confidence interval of the median
(as benchmarks/dp_vs_ddp.py), "<= 1 (met)" only when the whole interval is at or below 1.00.
Bytes on disk per save for both.

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
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

import phalanx as px
import phalanx.checkpoint as ckpt


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _states(kind: str, mb: int):
    """(phalanx state, DCP state, fresh-target factory for each) for one rank.

    ``replicated``: a model of ``mb`` MiB fp32 + its Adam state, the same on every rank (data
    parallel), + the rank's RNG state on the phalanx side. ``sharded``: the same model + Adam
    split over the ranks, each rank holding 1/np of every tensor (ZeRO-3 / FSDP style), as
    phalanx Shards and as DCP tensors under per-rank names (DCP's cheapest sharded form: no
    DTensor metadata to plan).
    """
    r, world = px.rank(), px.size()
    n = mb * (1 << 20) // 4 // 16
    model, opt = _model_and_adam(n, seed=0, grad=1.0)
    if kind == "replicated":
        def fresh():  # other values everywhere: a load that writes nothing shows
            return _model_and_adam(n, seed=1, grad=0.0)

        def px_target():
            m, o = fresh()
            return {"model": m, "optim": o, "rng": ckpt.RNGState()}, lambda: _flat(m, o)

        def dcp_target():
            m, o = fresh()
            sd = {"model": m.state_dict(), "optim": o.state_dict()}

            def apply():  # DCP's documented flow for a plain module: load into state dicts, then apply
                m.load_state_dict(sd["model"])
                o.load_state_dict(sd["optim"])
            return sd, apply, lambda: _flat(m, o)

        px_state = {"model": model, "optim": opt, "rng": ckpt.RNGState()}
        dcp_state = {"model": model.state_dict(), "optim": opt.state_dict()}
        return px_state, dcp_state, px_target, dcp_target, _flat(model, opt)
    flat = _flat(model, opt)
    mine = {}
    for name, t in flat.items():
        rows = t.shape[0]
        lo, hi = rows * r // world, rows * (r + 1) // world
        mine[name] = (t[lo:hi].clone(), tuple(t.shape), lo)
    px_state = {"state": {k: ckpt.Shard(t, g, (lo,) + (0,) * (len(g) - 1)) for k, (t, g, lo) in mine.items()}}
    dcp_state = {f"{k}.r{r}": t for k, (t, _, _) in mine.items()}

    def px_target():
        tgt = {"state": {k: ckpt.Shard(torch.empty_like(t), g, (lo,) + (0,) * (len(g) - 1))
                         for k, (t, g, lo) in mine.items()}}
        return tgt, lambda: {k: s.tensor for k, s in tgt["state"].items()}

    def dcp_target():
        tgt = {k: torch.empty_like(t) for k, t in dcp_state.items()}
        return tgt, lambda: None, lambda: {k.rsplit(".r", 1)[0]: v for k, v in tgt.items()}

    return px_state, dcp_state, px_target, dcp_target, {k: t for k, (t, _, _) in mine.items()}


def _model_and_adam(n: int, seed: int, grad: float):
    """16 bias-free Linear(n/64 -> 64) layers (n values in all) and Adam after one step on a gradient of ``grad``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(n // 64, 64, bias=False) for _ in range(16)])
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    opt.step()
    return model, opt


def _flat(model, opt) -> dict:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if k != "step":
                out[f"optim.{pid}.{k}"] = v
    return out


def _matrix_rank(kind: str, mb: int, repeats: int, root: str, async_samples: int = 3) -> dict:
    """One cell group on every rank. A warm-up round first (both sides allocate their staging
    memory and fault in their code paths; its async blocked times are kept apart as ``first``),
    then per repeat, every operation run by phalanx and DCP back to back (who goes first
    alternates per repeat): sync save, load (+ apply), then ``async_samples`` async saves per
    side, alternating, each waited for (blocked time, time until durable on every rank); a
    repeat's async figure is the median of its samples. Times are per rank; the caller takes the
    slowest rank of each repeat."""
    import torch.distributed.checkpoint as dcp

    r = px.rank()
    px_state, dcp_state, px_target, dcp_target, expect = _states(kind, mb)
    keys = ("save", "load", "block", "durable", "bytes", "first_block")
    out = {f"{w}_{k}": [] for w in ("px", "dcp") for k in keys}

    def timed(fn) -> float:
        px.barrier()
        t0 = time.perf_counter()
        fn()
        px.barrier()
        return time.perf_counter() - t0

    def check(got: dict) -> None:
        bad = [k for k in expect if not torch.equal(got[k], expect[k])]
        assert not bad, f"{kind}: loaded values differ at {bad[:3]}"

    def remove(*paths: str) -> None:
        px.barrier()
        if r == 0:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        px.barrier()

    def save(who: str, path: str) -> float:
        if who == "px":
            return timed(lambda: ckpt.save(path, px_state))
        return timed(lambda: dcp.save(dcp_state, checkpoint_id=path))

    def load(who: str, path: str) -> float:
        if who == "px":
            tgt, flat = px_target()
            took = timed(lambda: ckpt.load(path, tgt))
        else:
            tgt, apply, flat = dcp_target()
            took = timed(lambda: (dcp.load(tgt, checkpoint_id=path), apply()))
        check(flat())
        return took

    def async_save(who: str, path: str) -> tuple[float, float]:
        px.barrier()
        t0 = time.perf_counter()
        if who == "px":
            ckpt.save(path, px_state, async_=True)
            blocked = time.perf_counter() - t0
            ckpt.wait()  # ends with a barrier: the manifest exists
        else:
            fut = dcp.async_save(dcp_state, checkpoint_id=path)
            blocked = time.perf_counter() - t0
            fut.result()
            px.barrier()  # the coordinator wrote .metadata
        return blocked, time.perf_counter() - t0

    for i in range(-1, repeats):  # i = -1: the warm-up round, not counted
        order = ("px", "dcp") if i % 2 == 0 else ("dcp", "px")
        paths = {who: os.path.join(root, f"{who}-sync-{i}") for who in order}
        for who in order:
            took = save(who, paths[who])
            if i >= 0:
                out[f"{who}_save"].append(took)
                out[f"{who}_bytes"].append(_disk_bytes(paths[who]) if r == 0 else 0)
        for who in order:
            took = load(who, paths[who])
            if i >= 0:
                out[f"{who}_load"].append(took)
        remove(*paths.values())
        samples: dict[str, list] = {who: [] for who in order}
        for s in range(async_samples if i >= 0 else 1):
            for who in (order if s % 2 == 0 else order[::-1]):
                apath = os.path.join(root, f"{who}-async-{i}-{s}")
                samples[who].append(async_save(who, apath))
                remove(apath)
        for who in order:
            if i < 0:
                out[f"{who}_first_block"].append(samples[who][0][0])
                continue
            out[f"{who}_block"].append(statistics.median(b for b, _ in samples[who]))
            out[f"{who}_durable"].append(statistics.median(d for _, d in samples[who]))
    return out


CELLS = (("sync save", "save"), ("load", "load"), ("async save: blocked", "block"),
         ("async save: until durable", "durable"))


def _matrix(args) -> list[dict]:
    """Every cell of (replicated, sharded) x ranks x (sync save, load, async blocked, async durable)."""
    from dp_vs_ddp import median_ci  # this script's folder is on sys.path when it runs

    rows = []
    kinds = [k for k in ("replicated", "sharded") if args.kind in (k, "both")]
    for kind in kinds:
        for world in args.nps:
            root = args.dir or tempfile.mkdtemp(prefix="phalanx-ckpt-bench-", dir="/tmp")
            try:
                results = px.run(_matrix_rank, np=world, args=(kind, args.mb, args.repeats, root, args.async_samples),
                                 timeout=3600)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            mib = {w: statistics.median(results[0][f"{w}_bytes"]) / 2**20 for w in ("px", "dcp")}
            # the warm-up round's async save (fresh staging memory on both sides): reported, not counted
            first = {w: max(res[f"{w}_first_block"][0] for res in results) for w in ("px", "dcp")}
            for label, key in CELLS:
                # a save is as slow as its slowest rank: the max over ranks per repeat, then paired ratios
                t = {w: [max(res[f"{w}_{key}"][i] for res in results) for i in range(args.repeats)]
                     for w in ("px", "dcp")}
                ratio = [a / b for a, b in zip(t["px"], t["dcp"])]
                ci = median_ci(ratio)
                verdict = ("too few repeats" if ci is None else "<= 1 (met)" if ci[1] <= 1.0
                           else "> 1 (NOT met)" if ci[0] > 1.0 else "unresolved")
                rows.append({"kind": kind, "np": world, "cell": label, "px_ms": 1e3 * statistics.median(t["px"]),
                             "dcp_ms": 1e3 * statistics.median(t["dcp"]), "ratio": statistics.median(ratio),
                             "ci": ci, "verdict": verdict, "px_mib": mib["px"], "dcp_mib": mib["dcp"],
                             "ratios": [round(x, 3) for x in ratio],
                             "first_block_ms": {w: round(1e3 * v, 1) for w, v in first.items()}})
    return rows


def _print_matrix(args, rows: list[dict], loads: tuple) -> None:
    print(f"torch {torch.__version__}; model {args.mb} MiB fp32 + Adam = {3 * args.mb} MiB of state; "
          f"replicated: all of it on every rank; sharded: 1/np of every tensor per rank. A warm-up round, then "
          f"{args.repeats} repeats, each operation run by phalanx and DCP back to back (who goes first "
          f"alternates); async: median of {args.async_samples} alternating saves per side per repeat; time = "
          f"slowest rank; ratio = phalanx/DCP per repeat (lower is better), its median and 95% CI of the "
          f"median; checksum {ckpt.io.checksum_algorithm()}; load average {loads[0]:.1f} at the start, "
          f"{loads[1]:.1f} at the end")
    print(f"{'state':10s} {'np':>2s} {'cell':26s} {'phalanx ms':>10s} {'DCP ms':>8s} {'px/DCP':>7s} "
          f"{'95% CI':>13s}  {'verdict':15s} {'MiB px/DCP':>14s}")
    for row in rows:
        ci = f"{row['ci'][0]:.2f}-{row['ci'][1]:.2f}" if row["ci"] else "-"
        print(f"{row['kind']:10s} {row['np']:2d} {row['cell']:26s} {row['px_ms']:10.1f} {row['dcp_ms']:8.1f} "
              f"{row['ratio']:7.2f} {ci:>13s}  {row['verdict']:15s} {row['px_mib']:6.1f}/{row['dcp_mib']:.1f}")
    for row in rows:
        if row["cell"] == "async save: blocked":
            f = row["first_block_ms"]
            print(f"first async save (warm-up, fresh staging memory on both sides), {row['kind']} {row['np']} "
                  f"ranks: phalanx {f['px']:.1f} ms, DCP {f['dcp']:.1f} ms (not counted above)")


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="MiB of fp32 model (state = model + Adam = 3x)")
    ap.add_argument("--repeats", type=int, default=7, help="paired repeats per cell group (0: skip the matrix)")
    ap.add_argument("--async-samples", type=int, default=3,
                    help="async saves per side per repeat (alternating); a repeat's figure is their median")
    ap.add_argument("--nps", default="2,4", help="world sizes of the matrix, comma-separated")
    ap.add_argument("--kind", default="both", choices=("replicated", "sharded", "both"))
    ap.add_argument("--recovery-repeats", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on local disk)")
    ap.add_argument("--json", default=None, help="also write the matrix rows to this file")
    ap.add_argument("--recovery-worker", default=None, help=argparse.SUPPRESS)
    # the older commands in benchmarks/LOG.md: --replicated --np N (one cell group of the matrix now)
    ap.add_argument("--replicated", action="store_true", help="= --kind replicated")
    ap.add_argument("--np", type=int, default=None, help="= --nps N")
    args = ap.parse_args()
    if args.replicated:
        args.kind = "replicated"
    args.nps = [args.np] if args.np else [int(x) for x in args.nps.split(",")]
    if args.recovery_worker:
        return _recovery_worker(args.recovery_worker)
    if args.repeats:
        before = os.getloadavg()[0]
        rows = _matrix(args)
        loads = (before, os.getloadavg()[0])
        _print_matrix(args, rows, loads)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "load_average": loads, "rows": rows}, f, indent=1)
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
