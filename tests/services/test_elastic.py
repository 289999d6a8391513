"""Elastic training: sampler re-sharding, commit/restore/sync on real ranks, a kill-three-workers soak
through `phalanx run --max-restarts` (TorchElastic group restarts) and a discovery-driven grow 2 -> 3
(in-process), compared with an uninterrupted single-process run."""

import argparse
import os
import random
import subprocess
import sys
import textwrap

import elastic_job
import pytest
import torch

import phalanx as px
from phalanx import elastic
from phalanx.launcher.launch_options import add_elastic_arguments, elastic_launch_options
from phalanx.testing import distributed

pytestmark = pytest.mark.ranks

# ---------------------------------------------------------------- sampler


def test_sampler_reshards_remaining_data_when_world_changes():
    n, G = 50, 12
    seen = []
    first = [elastic.ElasticSampler(n, seed=4, rank=r, world_size=4) for r in range(4)]
    for s in first:
        seen += s.indices[: G // 4]
        s.record_batch(G // 4)
    sd = first[0].state_dict()
    assert sd["processed"] == G
    # the job now continues on 3 ranks: the rest of the epoch, re-dealt, nothing repeated or skipped
    rest = []
    for r in range(3):
        s = elastic.ElasticSampler(n, seed=4, rank=r, world_size=3)
        s.load_state_dict(sd)
        rest += list(s)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(4)).tolist()
    assert sorted(seen) == sorted(order[:G])
    assert sorted(rest) == sorted(order[G:G + (n - G) // 3 * 3])  # equal shares: the remainder is dropped
    assert not set(seen) & set(rest)
    s.set_epoch(1)
    assert s.processed == 0 and s.indices != order[2::3]
    with pytest.raises(ValueError, match="num_samples"):
        elastic.ElasticSampler(10).load_state_dict(sd)


# ---------------------------------------------------------------- state on real ranks


def _commit_restore_sync(root):
    r = px.rank()
    torch.manual_seed(r)  # ranks start different; sync() makes them rank 0's
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    state = elastic.TorchState(model, opt, commit_dir=os.path.join(root, "commits"), step=0, epoch=0)
    calls = []

    @elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < 6:
            loss = model(torch.ones(4, 3)).sum()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                px.allreduce(p.grad, op=px.Average, inplace=True)
            opt.step()
            state.step += 1
            if state.step == 3:
                state.commit()
            if state.step == 5 and len(calls) == 1:
                raise elastic.HostsUpdatedInterrupt("pretend a host joined")  # roll back to step 3
        return [p.detach().clone() for p in model.parameters()]

    params = train(state)
    # a new process (as after a TorchElastic restart) restores from the snapshot, not from memory
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"  # (a restart: this process's states count from 1 again)
    torch.manual_seed(100 + r)
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    fresh = elastic.TorchState(model2, opt2, commit_dir=os.path.join(root, "commits"), step=0, epoch=0)
    restored = fresh.restore()
    return {"params": params, "calls": calls, "restored": restored, "fresh_step": fresh.step,
            "commits": fresh.commits, "momentum": opt2.state_dict()["state"][0]["momentum_buffer"]}


def test_commit_restore_sync_and_retry(tmp_path):
    res = distributed(_commit_restore_sync, np=2, args=(str(tmp_path),))
    # reference: one process, same start (rank 0's), 6 steps with no interruption
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(6):
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
        if step == 2:
            mom3 = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    for out in res:
        assert out["calls"] == [0, 3]  # first call, then the retry from the commit at step 3
        for got, want in zip(out["params"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
        assert out["restored"] and out["fresh_step"] == 3 and out["commits"] == 1
        torch.testing.assert_close(out["momentum"], mom3, rtol=0, atol=0)


def _resize_segment(root, global_batch):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    state = elastic.TorchState(model, opt, sched=sched, batch=0, step=0, commit_dir=root)
    calls = []
    state.on_world_change(lambda old, new: calls.append((old, new)))
    state.on_world_change(elastic.scale_lr(opt, sched))
    state.on_world_change(elastic.keep_global_batch(state, "batch", global_batch))
    start_batch = state.batch  # set at registration for the current size

    @elastic.run
    def train(state):
        state.step += 1
        state.commit()

    train(state)
    return {"calls": calls, "lr": opt.param_groups[0]["lr"], "initial_lr": opt.param_groups[0]["initial_lr"],
            "base_lrs": sched.base_lrs, "batch": state.batch, "start_batch": start_batch, "step": state.step}


def test_world_size_change_runs_lr_and_batch_rescaling_hooks(tmp_path):
    root = str(tmp_path / "commits")
    first = _resize_segment(root, 12)  # this process, a world of one: commits at size 1
    assert first["calls"] == [] and first["batch"] == 12 and first["lr"] == 0.1  # fresh start: no hook
    second = distributed(_resize_segment, np=2, args=(root, 12))  # resumes the commit made at size 1
    for r in second:
        assert r["calls"] == [(1, 2)] and r["step"] == 2
        assert r["lr"] == pytest.approx(0.2) and r["initial_lr"] == pytest.approx(0.2)  # linear scaling rule
        assert r["base_lrs"] == [pytest.approx(0.2)] and r["batch"] == 6 and r["start_batch"] == 6
    # (2 -> 3 with keep_global_batch, end to end: test_discovery_script_grows_the_job_at_the_next_commit)
    holder = argparse.Namespace()
    hook = elastic.keep_global_batch(holder, "batch", 9)  # set now for this process's world of one
    assert holder.batch == 9
    with pytest.raises(ValueError, match="does not split over 2 workers"):
        hook(1, 2)


def test_launch_options_validate_and_export(tmp_path):
    p = argparse.ArgumentParser()
    add_elastic_arguments(p)
    env = {}
    out = elastic_launch_options(p.parse_args(["--max-restarts", "2", "--resume-from", str(tmp_path)]), 4, env)
    assert out == {"max_restarts": 2} and env["PHALANX_RESUME_FROM"] == str(tmp_path)
    out = elastic_launch_options(p.parse_args(["--min-np", "2", "--max-np", "8"]), 4, {})
    assert out == {"max_restarts": 3, "min_nodes": 1, "max_nodes": 2, "rdzv_extra": {"last_call_timeout": 2}}
    with pytest.raises(ValueError, match="--min-np 5 is larger than -np 4"):
        elastic_launch_options(p.parse_args(["--min-np", "5"]), 4, {})
    with pytest.raises(ValueError, match="--max-np 2 is smaller"):
        elastic_launch_options(p.parse_args(["--max-np", "2"]), 4, {})
    with pytest.raises(ValueError, match="not an executable"):
        elastic_launch_options(p.parse_args(["--host-discovery-script", str(tmp_path / "nope.sh")]), 4, {})


# ---------------------------------------------------------------- soak: kill three workers


TOTAL, COMMIT, G, N_DATA = 40, 4, 16, 96

WORKER = textwrap.dedent(f"""
    import os, signal, sys, time
    import torch
    import phalanx as px
    from phalanx import elastic

    TOTAL, COMMIT, G, N_DATA = {TOTAL}, {COMMIT}, {G}, {N_DATA}

""") + elastic_job.HELPERS + textwrap.dedent("""

    def main(out, kills):
        px.init()
        r, n = px.rank(), px.size()
        x, y = data()
        model, opt = make()
        sampler = elastic.ElasticSampler(N_DATA, seed=1)
        state = elastic.TorchState(model, opt, sampler=sampler, step=0, commit_dir=os.path.join(out, "commits"))
        restart = elastic.restart_count()

        def event(text):
            with open(os.path.join(out, "events.txt"), "a") as f:
                f.write(f"{text} restart={restart} rank={r} t={time.time():.4f}\\n")

        @elastic.run
        def train(state):
            if r == 0:
                event(f"start step={state.step}")
            while state.step < TOTAL:
                step(model, opt, state.sampler, x, y, n)
                state.step += 1
                if restart < len(kills) and state.step == kills[restart][0] and r == kills[restart][1]:
                    event(f"kill step={state.step}")
                    os.kill(os.getpid(), signal.SIGKILL)
                if state.step % COMMIT == 0:
                    state.commit()
                if r == 0:
                    event(f"done step={state.step}")

        train(state)
        if r == 0:
            torch.save([p.detach() for p in model.parameters()], os.path.join(out, "final.pt"))
        px.shutdown()

    if __name__ == "__main__":
        kills = [tuple(map(int, k.split(":"))) for k in sys.argv[2].split(",") if k]
        main(sys.argv[1], kills)
""")


def test_soak_kill_three_workers_same_final_params(tmp_path):
    rng = random.Random(2026)
    # three kills at random steps (one per restart), each after the group's resume point, on random ranks
    kill_steps = sorted(rng.sample(range(COMMIT + 1, TOTAL - 1), 3))
    while any(b - a <= COMMIT for a, b in zip(kill_steps, kill_steps[1:])):
        kill_steps = sorted(rng.sample(range(COMMIT + 1, TOTAL - 1), 3))
    # 2 ranks: each group restart starts every rank again, and 2 show the same path as 4 for half the starts
    kills = [(s, rng.randrange(2)) for s in kill_steps]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--max-restarts", "3", "--timeout", "60",
           sys.executable, str(script), str(tmp_path), ",".join(f"{s}:{r}" for s, r in kills)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [line.split() for line in (tmp_path / "events.txt").read_text().splitlines()]
    fields = [dict(kv.split("=") for kv in e[1:]) | {"what": e[0]} for e in events]
    starts = [int(f["step"]) for f in fields if f["what"] == "start"]
    killed = [(int(f["step"]), int(f["rank"])) for f in fields if f["what"] == "kill"]
    assert killed == kills and len(starts) == 4, (killed, starts)
    lost = [k - s for (k, _), s in zip(killed, starts[1:])]
    print(f"\nkills (step, rank): {kills}; resumed at steps {starts[1:]}; steps lost per failure: {lost}")
    assert all(0 <= n <= COMMIT for n in lost), lost  # at most the steps since the last commit
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    reference, _ = elastic_job.reference(WORKER, TOTAL, N_DATA)
    for got, want in zip(final, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    ns = {}
    exec(compile(WORKER, "worker", "exec"), ns)
    init = [p.detach() for p in ns["make"]()[0].parameters()]
    assert max((a - b).abs().max() for a, b in zip(reference, init)) > 1e-2  # training moved: not vacuous


# ---------------------------------------------------------------- host discovery: grow 2 -> 3 at a commit


DISC_TOTAL, DISC_N_DATA = 24, 96
DISCOVERY_WORKER = textwrap.dedent(f"""
    import os, sys, time
    import torch
    import phalanx as px
    from phalanx import elastic
    from phalanx.elastic import inprocess

    TOTAL, COMMIT, G, N_DATA, GROW_AT = {DISC_TOTAL}, 4, 12, {DISC_N_DATA}, 6
""") + elastic_job.HELPERS + textwrap.dedent("""
    def main(out, hosts_file):
        px.init()
        x, y = data()
        model, opt = make()
        state = elastic.TorchState(model, opt, sampler=elastic.ElasticSampler(N_DATA, seed=1), step=0,
                                   batch=0, commit_dir=os.path.join(out, "commits"))
        changes = []
        state.on_world_change(lambda old, new: changes.append((old, new)))
        state.on_world_change(elastic.keep_global_batch(state, "batch", G))

        @elastic.run
        def train(state):
            r, n = px.rank(), px.size()  # read inside: the job re-forms in-process at another size
            if r == 0:
                with open(os.path.join(out, "events.txt"), "a") as f:
                    f.write(f"start {state.step} {n} {state.batch} {changes} {os.getpid()}\\n")
            while state.step < TOTAL:
                step(model, opt, state.sampler, x, y, n, state.batch)
                state.step += 1
                if r == 0 and n == 2 and state.step == GROW_AT:
                    with open(hosts_file, "w") as f:
                        f.write("localhost:3\\n")        # a third slot appears
                    for _ in range(6000):                  # wait (a bounded number of polls, no hang)
                        if inprocess.latest_generation() > inprocess.generation():
                            break                          # until the launcher started and published it
                        time.sleep(0.01)
                    else:
                        raise AssertionError("the launcher never admitted a third worker")
                if state.step % COMMIT == 0:
                    state.commit()

        train(state)
        if px.rank() == 0:
            torch.save([p.detach() for p in model.parameters()], os.path.join(out, "final.pt"))
        px.shutdown()

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
""")


def test_discovery_script_grows_the_job_at_the_next_commit(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    worker = tmp_path / "worker.py"
    worker.write_text(DISCOVERY_WORKER)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--min-np", "1", "--max-np", "4",
           "--host-discovery-script", str(script), "--discovery-interval", "0.2", "--timeout", "60",
           sys.executable, str(worker), str(tmp_path), str(hosts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"
    print(f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")  # shown in full by pytest on a failure
    assert proc.returncode == 0, report
    assert "2 -> 3 workers at the next commit" in proc.stdout, report
    starts = [line.split() for line in (tmp_path / "events.txt").read_text().splitlines()]
    # first: 2 workers, 6 samples each; then in the same rank-0 process, 3 workers from the commit at
    # step 8 (GROW_AT 6 -> next commit), 4 samples each, after the hook saw 2 -> 3; no step lost or repeated
    assert [s[1:4] for s in starts] == [["0", "2", "6"], ["8", "3", "4"]], (starts, report)
    assert " ".join(starts[1][4:6]) == "[(2, 3)]" and starts[0][-1] == starts[1][-1], starts
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for got, want in zip(final, elastic_job.reference(DISCOVERY_WORKER, DISC_TOTAL, DISC_N_DATA)[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
