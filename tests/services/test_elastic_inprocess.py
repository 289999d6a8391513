"""In-process elastic recovery (Horovod's model) through `phalanx run --min-np/--max-np`, compared with an
uninterrupted single-process run: survivors of a SIGKILL keep their processes, a replacement is admitted at
a commit, too few workers stop the job, and a remote host that appears in the discovery output is admitted
at the next commit (simulated cluster with real sshd; root only, skipped elsewhere with the reason)."""

import os
import subprocess
import sys
import textwrap

import elastic_job
import pytest
import torch

from phalanx.testing.cluster import IFNAME, SimCluster, requirements_missing

pytestmark = pytest.mark.cluster

TOTAL, COMMIT, G, N_DATA, KILL_AT = 28, 4, 12, 96, 10

WORKER = textwrap.dedent(f"""
    import os, signal, sys, time
    import torch
    import phalanx as px
    from phalanx import elastic
    from phalanx.elastic import inprocess

    TOTAL, COMMIT, G, N_DATA, KILL_AT = {TOTAL}, {COMMIT}, {G}, {N_DATA}, {KILL_AT}

""") + elastic_job.HELPERS + textwrap.dedent("""

    def wait_for_next_generation():
        # (rank 0) hold on until the launcher has published the joiner, so it is admitted at the next commit
        for _ in range(6000):
            if inprocess.latest_generation() > inprocess.generation():
                return
            time.sleep(0.01)
        raise AssertionError("no new generation was published")

    def main(out, mode):
        px.init()
        x, y = data()
        model, opt = make()
        state = elastic.TorchState(model, opt, sampler=elastic.ElasticSampler(N_DATA, seed=1), step=0,
                                   commit_dir=os.path.join(out, "commits"))
        net = os.readlink("/proc/self/ns/net")

        def event(what):
            with open(os.path.join(out, "events.txt"), "a") as f:
                f.write(f"{what} step={state.step} rank={px.rank()} size={px.size()} pid={os.getpid()} "
                        f"gen={inprocess.generation()} net={net} t={time.time():.4f}\\n")

        @elastic.run
        def train(state):
            event("start")
            waited = False
            while state.step < TOTAL:
                step(model, opt, state.sampler, x, y, px.size())
                state.step += 1
                first_group = inprocess.generation() == 0 and elastic.restart_count() == 0
                if mode in ("kill", "lose") and first_group and state.step == KILL_AT and px.rank() == 2:
                    event("kill")
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "kill" and px.rank() == 0 and inprocess.generation() == 1 and not waited:
                    waited = True
                    wait_for_next_generation()   # the replacement (--max-restarts 1) is ready
                if mode == "grow" and state.step == KILL_AT and px.rank() == 0 and px.size() == 2:
                    with open(os.path.join(out, "hosts.txt"), "a") as f:
                        f.write(os.environ["PHALANX_TEST_GROW_HOST"] + "\\n")   # a new host appears in the discovery
                    wait_for_next_generation()   # the launcher started a worker there; it is ready
                if state.step % COMMIT == 0:
                    state.commit()
                event("done")

        train(state)
        event("end")
        if px.rank() == 0:
            torch.save([p.detach() for p in model.parameters()], os.path.join(out, "final.pt"))

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
""")


def _events(path):
    rows = []
    for line in path.read_text().splitlines():
        what, *kv = line.split()
        rows.append({"what": what, **{k: (v if k == "net" else float(v) if k == "t" else int(v))
                                      for k, v in (x.split("=", 1) for x in kv)}})
    return rows


def _check_final(out):
    final = torch.load(out / "final.pt", weights_only=True)
    for got, want in zip(final, elastic_job.reference(WORKER, TOTAL, N_DATA)[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_killed_worker_survivors_keep_running_and_match_reference(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "4", "--min-np", "2", "--max-np", "4",
           "--max-restarts", "1", "--timeout", "60", sys.executable, str(script), str(tmp_path), "kill"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    ev = _events(tmp_path / "events.txt")
    first = {e["rank"]: e["pid"] for e in ev if e["what"] == "start" and e["gen"] == 0}
    kill = [e for e in ev if e["what"] == "kill"]
    assert len(first) == 4 and len(kill) == 1 and kill[0]["rank"] == 2, report
    survivors = {p for r, p in first.items() if r != 2}
    # the survivors re-formed as 3 ranks in the same processes: no restart
    after = [e for e in ev if e["what"] == "start" and e["gen"] == 1]
    assert {e["pid"] for e in after} == survivors and {e["size"] for e in after} == {3}, (after, report)
    lost = kill[0]["step"] - after[0]["step"]
    print(f"\nkilled rank 2 at step {kill[0]['step']}; survivors resumed at step {after[0]['step']} "
          f"(steps lost: {lost}) {after[0]['t'] - kill[0]['t']:.2f}s after the kill")
    assert 0 <= lost <= COMMIT and after[0]["step"] % COMMIT == 0
    # a replacement (--max-restarts 1) was admitted at a later commit: 4 ranks again, survivors still there
    grown = [e for e in ev if e["what"] == "start" and e["gen"] == 2]
    assert {e["size"] for e in grown} == {4} and survivors < {e["pid"] for e in grown}, (grown, report)
    assert grown[0]["step"] % COMMIT == 0 and grown[0]["step"] > after[0]["step"]
    ends = [e for e in ev if e["what"] == "end"]
    assert len(ends) == 4 and survivors < {e["pid"] for e in ends}
    assert "recovery path: in-process" in proc.stdout and "TorchElastic" not in proc.stdout + proc.stderr, report
    _check_final(tmp_path)


def test_too_few_workers_stop_the_job_with_a_clear_error(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("px.rank() == 2", "px.rank() == 1"))
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--min-np", "2", "--max-restarts", "0",
           "--timeout", "60", sys.executable, str(script), str(tmp_path), "kill"]
    # no hang: the launcher stops the job as soon as it sees the worker die
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "fewer than --min-np 2" in proc.stderr and "killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "final.pt").exists()


def test_survivors_that_cannot_reform_fall_back_to_a_group_restart(tmp_path):
    # --min-np 2: the survivor must wait for the replacement, but may wait only 1 s
    # (PHALANX_ELASTIC_REFORM_TIMEOUT) while it imports torch: it exits 75 and the launcher
    # restarts the whole group on TorchElastic from the last snapshot
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("px.rank() == 2", "px.rank() == 1"))
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--min-np", "2", "--max-restarts", "1",
           "--timeout", "60", sys.executable, str(script), str(tmp_path), "kill"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PHALANX_ELASTIC_REFORM_TIMEOUT": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    assert "recovery path: group restart on TorchElastic" in proc.stderr, report
    ev = _events(tmp_path / "events.txt")
    kill_t = next(e["t"] for e in ev if e["what"] == "kill")
    first = {e["pid"] for e in ev if e["what"] == "start" and e["t"] < kill_t}
    ends = [e for e in ev if e["what"] == "end"]
    assert len(first) == 2 and len(ends) == 2 and not first & {e["pid"] for e in ends}, report  # all restarted
    _check_final(tmp_path)


# ---------------------------------------------------------------- a remote host appears mid-run

_why = requirements_missing(ssh=True)


@pytest.mark.skipif(_why is not None, reason=f"simulated cluster unavailable: {_why}")
def test_remote_host_from_discovery_is_admitted_at_the_next_commit(tmp_path):
    with SimCluster(hosts=2, rate=None, ssh=True) as cluster:
        a, b = cluster.addresses
        hosts = tmp_path / "hosts.txt"
        hosts.write_text(f"{a}:2\n")
        discover = tmp_path / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
        discover.chmod(0o755)
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--min-np", "2", "--max-np", "3",
               "--host-discovery-script", str(discover), "--discovery-interval", "0.3",
               "--ssh-config", cluster.ssh_config, "--network-interface", IFNAME, "--timeout", "60",
               sys.executable, str(script), str(tmp_path), "grow"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PHALANX_TEST_GROW_HOST": f"{b}:1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        nets = [cluster.exec(i, ["readlink", "/proc/self/ns/net"]).stdout.strip() for i in range(2)]
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    ev = _events(tmp_path / "events.txt")
    first = [e for e in ev if e["what"] == "start" and e["gen"] == 0]
    grown = [e for e in ev if e["what"] == "start" and e["gen"] > 0]
    assert {e["net"] for e in first} == {nets[0]} and len(first) == 2, report  # both on host a at first
    assert len(grown) == 3 and {e["size"] for e in grown} == {3}, (grown, report)
    assert [e["net"] for e in sorted(grown, key=lambda e: e["rank"])] == [nets[0], nets[0], nets[1]]
    # admitted at the first commit after the host appeared (step KILL_AT), the first two kept their processes
    assert {e["step"] for e in grown} == {(KILL_AT // COMMIT + 1) * COMMIT}, grown
    assert {e["pid"] for e in first} < {e["pid"] for e in grown}
    _check_final(tmp_path)


@pytest.mark.skipif(_why is not None, reason=f"simulated cluster unavailable: {_why}")
def test_remote_host_list_recovers_in_process_and_sets_the_failed_host_aside(tmp_path):
    # -H with a remote host and --min-np: the in-process supervisor starts the workers over SSH (not one
    # TorchElastic agent per host); the worker on host b is killed, the survivors on host a re-form in their
    # own processes, and host b is set aside (Horovod's rule for a named host), so the job ends at size 2
    with SimCluster(hosts=2, rate=None, ssh=True) as cluster:
        a, b = cluster.addresses
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        cmd = [sys.executable, "-m", "phalanx", "run", "-H", f"{a}:2,{b}:1", "-np", "3", "--min-np", "2",
               "--ssh-config", cluster.ssh_config, "--network-interface", IFNAME, "--timeout", "60",
               sys.executable, str(script), str(tmp_path), "lose"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        nets = [cluster.exec(i, ["readlink", "/proc/self/ns/net"]).stdout.strip() for i in range(2)]
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    ev = _events(tmp_path / "events.txt")
    first = sorted((e for e in ev if e["what"] == "start" and e["gen"] == 0), key=lambda e: e["rank"])
    assert [e["net"] for e in first] == [nets[0], nets[0], nets[1]], report  # host-major over the two hosts
    after = [e for e in ev if e["what"] == "start" and e["gen"] == 1]
    assert {e["pid"] for e in after} == {e["pid"] for e in first[:2]} and {e["size"] for e in after} == {2}, report
    assert not [e for e in ev if e["what"] == "start" and e["gen"] > 1], report  # host b stays aside
    assert "recovery path: in-process" in proc.stdout and "TorchElastic" not in proc.stdout + proc.stderr, report
    assert f"host {b}" in proc.stdout + proc.stderr, report  # named as set aside
    _check_final(tmp_path)
