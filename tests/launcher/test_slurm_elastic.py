"""Recovery inside a SLURM allocation, on the real test cluster (tests/jobs/slurm_cluster.py; root, slurm-wlm, munge).

* docs/slurm.md's ``salloc -N2 -n2 phalanx run --min-np 1 --max-np 2 …`` line: one worker per node, each its own ``srun`` step;
  the test ``scancel``s the step of the worker on n2 mid-run; the survivor on n1 re-forms in-process
  (same process), a replacement step starts on n2 (the node with a free slot) and is admitted at a
  commit; the job completes with both replicas equal to each other and to a one-process run.
* ``salloc -N2 -n2 phalanx run --max-restarts 1`` (no elastic flags: one agent per node): a worker that
  fails restarts the group once on both nodes, and the job succeeds.
"""

import os
import re
import subprocess
import sys
import textwrap
import time

import elastic_job
import pytest
import torch
from slurm_cluster import needs_slurm, slurm  # noqa: F401  (slurm: the session's cluster fixture)

pytestmark = pytest.mark.cluster

TOTAL, COMMIT, G, N_DATA, KILL_AT = 24, 4, 12, 96, 6
DOC = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "slurm.md")).read()

WORKER = textwrap.dedent(f"""
    import os, sys, time
    import torch
    import phalanx as px
    from phalanx import elastic
    from phalanx.elastic import inprocess

    TOTAL, COMMIT, G, N_DATA, KILL_AT = {TOTAL}, {COMMIT}, {G}, {N_DATA}, {KILL_AT}

""") + elastic_job.HELPERS + textwrap.dedent("""

    def main(out):
        px.init()
        x, y = data()
        model, opt = make()
        state = elastic.TorchState(model, opt, sampler=elastic.ElasticSampler(N_DATA, seed=1), step=0,
                                   commit_dir=os.path.join(out, "commits"))
        node = os.environ.get("SLURMD_NODENAME")

        def event(what):
            with open(os.path.join(out, "events.txt"), "a") as f:
                f.write(f"{what} step={state.step} rank={px.rank()} size={px.size()} pid={os.getpid()} "
                        f"gen={inprocess.generation()} node={node} procid={os.environ.get('SLURM_PROCID')}\\n")

        @elastic.run
        def train(state):
            event("start")
            waited = False
            while state.step < TOTAL:
                step(model, opt, state.sampler, x, y, px.size())
                state.step += 1
                if inprocess.generation() == 0 and state.step == KILL_AT and px.rank() == 1:
                    event("kill")  # the test scancels this worker's step now
                    with open(os.path.join(out, "kill.tmp"), "w") as f:
                        f.write(f"{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}")
                    os.rename(os.path.join(out, "kill.tmp"), os.path.join(out, "kill"))
                    while True:
                        time.sleep(0.1)
                if px.rank() == 0 and inprocess.generation() == 1 and not waited:
                    waited = True  # hold on until the replacement is published: it joins at the next commit
                    for _ in range(12000):
                        if inprocess.latest_generation() > inprocess.generation():
                            break
                        time.sleep(0.01)
                if state.step % COMMIT == 0:
                    state.commit()

        train(state)
        event("end")
        torch.save([p.detach() for p in model.parameters()], os.path.join(out, f"final.{px.rank()}.pt"))

    if __name__ == "__main__":
        main(os.getcwd())
""")


def _events(path):
    rows = []
    for line in path.read_text().splitlines():
        what, *kv = line.split()
        row = dict(x.split("=", 1) for x in kv)
        rows.append({"what": what, **{k: (int(v) if k not in ("node", "procid") else v) for k, v in row.items()}})
    return rows


@pytest.fixture(scope="module")
def restart_job(slurm, tmp_path_factory):  # noqa: F811
    """The --max-restarts job, started first so that it runs beside the elastic one (the cluster holds both)."""
    where = tmp_path_factory.mktemp("slurm_restart")
    (where / "restart.py").write_text(RESTART)
    job = slurm.start(["salloc", "-N2", "-n2", sys.executable, "-m", "phalanx", "run", "--max-restarts", "1",
                       "python", "restart.py"], cwd=where)
    yield job
    job.wait()


@needs_slurm
def test_elastic_in_allocation_survives_a_scancelled_step_and_replaces_it(slurm, tmp_path, restart_job):  # noqa: F811
    os.chmod(tmp_path, 0o755)
    (tmp_path / "train_elastic.py").write_text(WORKER)
    (line,) = [b.strip() for b in re.findall(r"```bash\n(.*?)```", DOC, re.S) if "--min-np" in b]
    assert line == "salloc -N2 -n2 phalanx run --min-np 1 --max-np 2 --max-restarts 1 python train_elastic.py"
    proc = subprocess.Popen(["bash", "-c", line], env={**slurm.env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "kill").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            time.sleep(0.1)
        step = (tmp_path / "kill").read_text()
        cancel = slurm.run(["scancel", step])
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    report = f"stdout:\n{out[-3000:]}\nstderr:\n{err[-4000:]}"
    assert cancel.returncode == 0, cancel.stderr
    assert proc.returncode == 0, report
    ev = _events(tmp_path / "events.txt")
    first = {e["rank"]: e for e in ev if e["what"] == "start" and e["gen"] == 0}
    assert sorted((r, e["node"]) for r, e in first.items()) == [(0, "n1"), (1, "n2")], report  # one per node
    assert {e["procid"] for e in first.values()} == {"None"}, report  # the step's SLURM_PROCID is not the rank's
    # the survivor re-formed alone in the same process: no restart
    after = [e for e in ev if e["what"] == "start" and e["gen"] == 1]
    assert [(e["pid"], e["size"]) for e in after] == [(first[0]["pid"], 1)], report
    assert "recovery path: in-process" in out, report
    # the replacement: a new srun step on n2 (the node with a free slot), admitted at a commit
    grown = {e["rank"]: e for e in ev if e["what"] == "start" and e["gen"] == 2}
    assert sorted(grown) == [0, 1] and grown[0]["pid"] == first[0]["pid"], report
    assert grown[1]["node"] == "n2" and grown[1]["pid"] != first[1]["pid"] and grown[1]["step"] % COMMIT == 0
    ends = [e for e in ev if e["what"] == "end"]
    assert sorted(e["rank"] for e in ends) == [0, 1], report
    finals = [torch.load(tmp_path / f"final.{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(*finals)), "replicas differ"
    for got, want in zip(finals[0], elastic_job.reference(WORKER, TOTAL, N_DATA)[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


RESTART = textwrap.dedent("""
    import os, sys, torch, phalanx as px
    topo = px.init()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restart == 0 and topo.rank == 1:
        sys.exit(3)  # the first attempt fails on one node
    t = torch.tensor([float(topo.rank + 1)])
    torch.distributed.all_reduce(t)
    print(f"rank {topo.rank} restart {restart} on {os.environ['SLURMD_NODENAME']} sum {t.item()}", flush=True)
    px.shutdown()
""")


@needs_slurm
def test_max_restarts_in_allocation_restarts_the_group_on_every_node(restart_job):
    res = restart_job.wait()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = sorted(ln.split(": ", 1)[1].split() for ln in res.stdout.splitlines() if " restart " in ln and ": rank" in ln)
    # (the restarted group's ranks follow the re-rendezvous order: rank 0 may now be on either node)
    assert [(r[1], r[3], r[5], r[7]) for r in rows] == [("0", "1", rows[0][5], "3.0"), ("1", "1", rows[1][5], "3.0")]
    assert sorted(r[5] for r in rows) == ["n1", "n2"], res.stdout  # once on each node, after one restart
    assert "not applied" not in res.stderr, res.stderr
