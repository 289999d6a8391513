"""Chaos soak: an elastic job under `phalanx run` while random workers are killed, frozen, made to raise or SIGTERMed.

Run:  flock /tmp/phalanx-bench.lock python benchmarks/chaos.py --minutes 10 --np 2 --seed 0
      (quick check: --minutes 1 --np 2 --faults 2)

The job: a data-parallel MLP (px.DataParallel) on scikit-learn's digits, a global batch of 64 split
over the ranks there are, phalanx.elastic TorchState/run with a commit every --commit-every steps,
under `phalanx run -np N --min-np 1 --max-np N` (in-process elastic; a lost worker is replaced and
admitted at a later commit). Rank 0 logs every completed step (step, world size, generation).

Faults, one at a time, at seeded random moments (a random wait after the job recovered), into a
random live worker: `kill` SIGKILL, `stop` SIGSTOP (a frozen worker: the launcher kills one silent
for 15 s and the survivors re-form), `raise` a marker file that makes that worker raise at its next
step, `term` SIGTERM. Only processes descending from the launcher this script started are ever
signalled (psutil children(recursive=True)); the next fault waits until a step has completed at the
full size again, or --bound seconds passed.

Then a fault-free run of the same job for the same number of steps (same seed, same -np).

Reports per kind: faults injected, recovered (a step completed by a later generation), steps lost
(steps redone: the last step reached before recovery minus the step recovery resumed from),
recovery time (fault -> next completed step: median and max) and time back to the full size; the
job's exit status; the final loss (full data set) of both runs and whether the final replicas are
bitwise equal across ranks. A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

WORKER = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import phalanx as px
    from phalanx import elastic as el
    from phalanx.elastic import inprocess
    from sklearn.datasets import load_digits

    OUT, A = sys.argv[1], json.loads(sys.argv[2])
    G, EVERY = 64, A["commit_every"]
    px.init()
    torch.manual_seed(A["seed"])
    d = load_digits()
    X = torch.tensor(d.data / 16.0, dtype=torch.float64)
    Y = torch.tensor(d.target, dtype=torch.long)
    N = len(X)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)).double()
    inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = px.DataParallel(net)
    sampler = el.ElasticSampler(N, shuffle=True, seed=A["seed"])
    state = el.TorchState(net, inner, sampler=sampler, step=0, commit_dir=OUT + "/c")
    RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def log(what, **kw):
        with open(OUT + "/log.jsonl", "a") as f:
            f.write(json.dumps({"what": what, "t": time.time(), "pid": os.getpid(), "rank": px.rank(),
                                "size": px.size(), "gen": inprocess.generation(), "restart": RESTART,
                                **kw}) + "\\n")

    def total():
        # the controller ends the soak by writing the step to stop at (well ahead of every rank)
        if A.get("total"):
            return A["total"]
        try:
            with open(OUT + "/stop") as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return 1 << 60

    @el.run
    def train(state):
        log("start", step=state.step)
        while state.step < total():
            if os.path.exists(f"{OUT}/raise.{os.getpid()}"):
                log("raise", step=state.step)
                raise RuntimeError(f"chaos: injected failure in pid {os.getpid()} at step {state.step}")
            n = px.size()
            if state.sampler.processed >= N - N % G:
                state.sampler.set_epoch(state.sampler.epoch + 1)
            idx = state.sampler.indices[:G // n]
            loss = torch.nn.functional.cross_entropy(model(X[idx]), Y[idx])
            inner.zero_grad()
            loss.backward()
            inner.step()
            state.sampler.record_batch(G // n)
            state.sampler.reset()
            state.step += 1
            if px.rank() == 0:
                log("step", step=state.step, loss=loss.item())
            if state.step % EVERY == 0:
                state.commit()

    train(state)
    with torch.no_grad():
        final = torch.nn.functional.cross_entropy(net(X), Y).item()
    torch.save([p.detach().clone() for p in net.parameters()], f"{OUT}/params.{px.rank()}.pt")
    if px.rank() == 0:
        log("end", step=state.step, final_loss=final)
''')

KINDS = ("kill", "stop", "raise", "term")


def rows(out: str) -> list[dict]:
    try:
        with open(os.path.join(out, "log.jsonl")) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    got = []
    for line in lines:
        try:
            got.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return got


def launch(out: str, np: int, args: dict, timeout: float) -> subprocess.Popen:
    script = os.path.join(out, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", str(np), "--min-np", "1", "--max-np", str(np),
           "--max-restarts", "100000", "--timeout", str(int(timeout)), sys.executable, script, out,
           json.dumps(args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(os.path.join(out, "launcher.log"), "w")
    # its own session: at the end, whatever is left of it is killed by its group id (only ours)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def workers(launcher: subprocess.Popen, script: str) -> list:
    """Live (running, not stopped) worker processes descending from our launcher."""
    import psutil
    try:
        kids = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    live = []
    for p in kids:
        try:
            if script in p.cmdline() and p.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE,
                                                            psutil.STATUS_DEAD):
                live.append(p)
        except psutil.Error:
            pass
    return live


def inject(kind: str, proc, out: str) -> None:
    if kind == "raise":
        open(os.path.join(out, f"raise.{proc.pid}"), "w").close()
    else:
        proc.send_signal({"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[kind])


def finish(launcher: subprocess.Popen, wait: float) -> int | None:
    try:
        return launcher.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)   # the session we started for it
        launcher.wait()
        return None


def soak(a, out: str) -> dict:
    rng = random.Random(a.seed)
    script = os.path.join(out, "worker.py")
    launcher = launch(out, a.np, {"seed": a.seed, "commit_every": a.commit_every}, a.timeout)
    faults: list[dict] = []
    status = None
    try:
        # wait (bounded) for the first step at the full size; the soak's minutes count from there
        t_start = time.time()
        while not any(r["what"] == "step" and r["size"] == a.np for r in rows(out)):
            if launcher.poll() is not None or time.time() > t_start + a.bound + 60:
                break
            time.sleep(0.2)
        t_end = time.time() + 60 * a.minutes
        while launcher.poll() is None and time.time() < t_end and len(faults) < a.faults:
            time.sleep(rng.uniform(a.gap_min, a.gap_max))
            live = workers(launcher, script)
            if not live or launcher.poll() is not None or time.time() >= t_end:
                break
            kind = rng.choice(a.kinds)
            victim = rng.choice(sorted(live, key=lambda p: p.pid))
            steps = [r for r in rows(out) if r["what"] == "step"]
            before = steps[-1] if steps else {"gen": -1, "restart": 0, "step": 0}
            t0 = time.time()
            try:
                inject(kind, victim, out)
            except Exception as e:  # it died meanwhile (psutil.NoSuchProcess)
                print(f"chaos: could not inject {kind} into pid {victim.pid}: {e}", file=sys.stderr)
                continue
            f = {"kind": kind, "pid": victim.pid, "t": t0, "key": (before["restart"], before["gen"])}
            faults.append(f)
            # wait for the job to recover: a later generation completes a step at the full size
            while time.time() < t0 + a.bound and launcher.poll() is None:
                later = [r for r in rows(out) if r["what"] == "step" and r["t"] > t0
                         and (r["restart"], r["gen"]) > f["key"]]
                if any(r["size"] == a.np for r in later):
                    break
                time.sleep(0.1)
        # end: a stop step well ahead of every rank (atomic write), then wait for the job to end
        if launcher.poll() is None:
            steps = [r["step"] for r in rows(out) if r["what"] == "step"]
            with open(os.path.join(out, "stop.tmp"), "w") as fh:
                fh.write(str(max(steps, default=0) + 2 * a.commit_every + 10))
            os.replace(os.path.join(out, "stop.tmp"), os.path.join(out, "stop"))
        status = finish(launcher, a.bound + 60)
    finally:
        if launcher.poll() is None:
            finish(launcher, 0)
    return {"faults": faults, "status": status, "rows": rows(out)}


def analyse(faults: list[dict], log: list[dict], np: int) -> None:
    steps = [r for r in log if r["what"] == "step"]
    for i, f in enumerate(faults):
        nxt = faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")
        later = [r for r in steps if f["t"] < r["t"] < nxt and (r["restart"], r["gen"]) > f["key"]]
        f["recovered"] = bool(later)
        if not later:
            continue
        first = later[0]
        f["recovery_s"] = first["t"] - f["t"]
        full_np = [r for r in later if r["size"] == np]
        f["full_size_s"] = full_np[0]["t"] - f["t"] if full_np else None
        reached = max((r["step"] for r in steps if r["t"] < first["t"]), default=0)
        f["steps_lost"] = reached - (first["step"] - 1)


def fault_free(a, out: str, total: int) -> dict:
    launcher = launch(out, a.np, {"seed": a.seed, "commit_every": a.commit_every, "total": total}, a.timeout)
    status = finish(launcher, 600)
    return {"status": status, "rows": rows(out)}


def replicas_equal(*outs: str) -> bool | None:
    """Every final replica (params.<rank>.pt) in these run folders bitwise equal (None: none written)."""
    import torch
    ps = [torch.load(os.path.join(out, f)) for out in outs for f in sorted(os.listdir(out))
          if f.startswith("params.")]
    if len(ps) < len(outs):
        return None
    return all(len(p) == len(ps[0]) and all(torch.equal(x, y) for x, y in zip(p, ps[0])) for p in ps)


def fmt(v, spec: str) -> str:
    return format(v, spec) if v is not None else "-".rjust(int(spec.rstrip("dfs").split(".")[0]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--kinds", default="kill,stop,raise", help="comma-separated, of " + ",".join(KINDS) +
                   " (term: elastic jobs now take SIGTERM as a preemption: every member saves and the job exits 85)")
    p.add_argument("--faults", type=int, default=1 << 30, help="stop injecting after this many faults")
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--gap-min", type=float, default=2.0, help="seconds after recovery before the next fault")
    p.add_argument("--gap-max", type=float, default=8.0)
    p.add_argument("--bound", type=float, default=90.0, help="seconds to wait for a recovery")
    p.add_argument("--timeout", type=float, default=20.0, help="phalanx run --timeout (collectives)")
    p.add_argument("--keep", metavar="DIR", help="keep both runs' logs in DIR/chaos and DIR/fault_free (new DIR)")
    a = p.parse_args()
    a.kinds = [k for k in a.kinds.split(",") if k]
    bad = [k for k in a.kinds if k not in KINDS]
    if bad or not a.kinds:
        p.error(f"--kinds: unknown {bad or 'empty'}; choose from {','.join(KINDS)}")
    if a.np < 2:
        p.error("--np must be at least 2 (a fault needs a survivor)")
    try:
        import psutil  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/chaos.py needs psutil (pip install psutil) to signal only the launcher's descendants")

    with contextlib.ExitStack() as stack:
        if a.keep:   # keep both runs' logs
            d1, d2 = os.path.join(a.keep, "chaos"), os.path.join(a.keep, "fault_free")
            os.makedirs(d1), os.makedirs(d2)
        else:
            d1, d2 = (stack.enter_context(tempfile.TemporaryDirectory()) for _ in range(2))
        t0 = time.time()
        chaos = soak(a, d1)
        wall = time.time() - t0
        faults = chaos["faults"]
        analyse(faults, chaos["rows"], a.np)
        end = next((r for r in chaos["rows"] if r["what"] == "end"), None)
        equal = replicas_equal(d1)
        total = end["step"] if end else None
        ref = fault_free(a, d2, total) if total else {"status": None, "rows": []}
        ref_end = next((r for r in ref["rows"] if r["what"] == "end"), None)
        same_as_ref = replicas_equal(d1, d2) if ref_end else None
        if chaos["status"] != 0:
            with open(os.path.join(d1, "launcher.log")) as fh:
                print("chaos job output (tail):\n" + fh.read()[-3000:], file=sys.stderr)

    print(f"chaos soak: np {a.np}, seed {a.seed}, {wall / 60:.1f} min, kinds {','.join(a.kinds)}, "
          f"commit every {a.commit_every} steps")
    print(f"{'kind':<6} {'injected':>8} {'recovered':>9} {'lost med':>8} {'lost max':>8} "
          f"{'recov med s':>11} {'recov max s':>11} {'full np max s':>13}")
    per_kind = {}
    for kind in [*a.kinds, "all"]:
        fs = [f for f in faults if kind in ("all", f["kind"])]
        rec = [f for f in fs if f["recovered"]]
        lost = [f["steps_lost"] for f in rec]
        rt = [f["recovery_s"] for f in rec]
        full = [f["full_size_s"] for f in rec if f.get("full_size_s") is not None]
        row = {"injected": len(fs), "recovered": len(rec), "steps_lost": lost,
               "recovery_s_median": statistics.median(rt) if rt else None, "recovery_s_max": max(rt, default=None),
               "full_size_s_max": max(full, default=None)}
        per_kind[kind] = row
        print(f"{kind:<6} {len(fs):>8} {len(rec):>9} {fmt(statistics.median(lost) if lost else None, '8.1f')} "
              f"{fmt(max(lost, default=None), '8d')} {fmt(row['recovery_s_median'], '11.2f')} "
              f"{fmt(row['recovery_s_max'], '11.2f')} {fmt(row['full_size_s_max'], '13.2f')}")
    loss = end["final_loss"] if end else None
    ref_loss = ref_end["final_loss"] if ref_end else None
    print(f"job exit status {chaos['status']}; steps {total}; final loss {loss} (fault-free, same steps and seed: "
          f"{ref_loss}, exit {ref['status']}); final replicas bitwise equal: {equal}; "
          f"bitwise equal to the fault-free run's: {same_as_ref}")
    print(json.dumps({"bench": "chaos", "np": a.np, "seed": a.seed, "minutes": round(wall / 60, 2),
                      "kinds": a.kinds, "commit_every": a.commit_every, "exit_status": chaos["status"],
                      "steps": total, "final_loss": loss, "fault_free_loss": ref_loss,
                      "fault_free_exit_status": ref["status"], "replicas_bitwise_equal": equal,
                      "equal_to_fault_free": same_as_ref,
                      "per_kind": per_kind,
                      "faults": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in f.items()
                                  if k not in ("t", "key")} for f in faults]}))


if __name__ == "__main__":
    main()
