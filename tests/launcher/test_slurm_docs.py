"""Every example of docs/slurm.md, run on the real SLURM test cluster; and the README's test command in CI.

salloc (no -np: one rank on each node, parameters bit-equal to ``phalanx run -np 2`` on one host),
the sbatch script (2 nodes x 2 workers; run without its --gpus-per-node line: no GPUs here) and
plain srun. The mpirun line is checked here and run by tests/launcher/test_mpirun.py.
"""

import os
import re
import sys

import pytest
from slurm_cluster import needs_slurm, slurm  # noqa: F401  (slurm: the session's cluster fixture)

pytestmark = pytest.mark.cluster

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DOC = open(os.path.join(ROOT, "docs", "slurm.md")).read()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", DOC, re.S)
LINE = re.compile(r"rank (\d+)/(\d+) local (\d+) on (.+?): loss \S+ params ([0-9a-f]{16})")


def _block(lang, start):
    found = [text for kind, text in BLOCKS if kind == lang and text.startswith(start)]
    assert len(found) == 1, f"docs/slurm.md: expected one {lang} block starting {start!r}, found {len(found)}"
    return found[0]


def _ranks(output):
    """{rank: (size, local, node, digest)} from the script's lines."""
    return {int(m[0]): (int(m[1]), int(m[2]), m[3], m[4]) for m in LINE.findall(output)}


@pytest.fixture(scope="module")
def runs(slurm, tmp_path_factory):  # noqa: F811
    """The page's salloc, sbatch and srun examples and the one-host reference, all started at once (the cluster
    holds them together: 1 + 2 + 1 of each node's 4 CPUs); each test collects its own and checks it."""
    where = tmp_path_factory.mktemp("slurm_docs")
    (where / "train.py").write_text(_block("python", "# train.py"))
    script = _block("bash", "#!/bin/bash")
    assert "#SBATCH --gpus-per-node=2\n" in script
    (where / "train.sbatch").write_text(script.replace("#SBATCH --gpus-per-node=2\n", ""))
    salloc, srun = _block("bash", "salloc -N2 -n2 phalanx run python").strip(), _block("bash", "srun").strip()
    assert salloc == "salloc -N2 -n2 phalanx run python train.py" and srun == "srun -N2 -n2 python train.py"
    started = {
        "salloc": slurm.start(["bash", "-c", salloc], cwd=where),
        "sbatch": slurm.start(["sbatch", "--wait", "train.sbatch"], cwd=where),
        "srun": slurm.start(["bash", "-c", srun], cwd=where),
        "one host": slurm.start([sys.executable, "-m", "phalanx", "run", "-np", "2", "python", "train.py"], cwd=where),
    }
    yield where, started
    for job in started.values():
        job.wait()


@needs_slurm
def test_doc_salloc_uses_every_node_and_matches_one_host(runs):
    res = runs[1]["salloc"].wait()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = _ranks(res.stdout)
    assert sorted(ranks) == [0, 1] and {r[0] for r in ranks.values()} == {2}, res.stdout  # -np = the 2 tasks
    assert sorted(r[2] for r in ranks.values()) == ["n1", "n2"], res.stdout  # one rank on each node
    ref = runs[1]["one host"].wait()
    assert ref.returncode == 0, ref.stderr[-3000:]
    one_host = _ranks(ref.stdout)
    assert {r[2] for r in one_host.values()} == {"this host"}
    digests = {r[3] for r in ranks.values()} | {r[3] for r in one_host.values()}
    assert len(digests) == 1, f"parameters differ: salloc {ranks} vs one host {one_host}"


@needs_slurm
def test_doc_sbatch_two_nodes_two_workers_each(runs):
    res = runs[1]["sbatch"].wait()
    job = re.search(r"Submitted batch job (\d+)", res.stdout)
    assert job, res.stdout + res.stderr
    output = (runs[0] / f"train-{job.group(1)}.out").read_text()
    assert res.returncode == 0, output[-3000:] + res.stderr
    ranks = _ranks(output)
    assert sorted(ranks) == [0, 1, 2, 3] and {r[0] for r in ranks.values()} == {4}, output
    by_node = sorted((r[2], r[1]) for r in ranks.values())
    assert by_node == [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)], output  # two workers on each node
    assert len({r[3] for r in ranks.values()}) == 1, output  # the replicas agree


@needs_slurm
def test_doc_plain_srun(runs):
    res = runs[1]["srun"].wait()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = _ranks(res.stdout)
    assert sorted(ranks) == [0, 1] and sorted(r[2] for r in ranks.values()) == ["n1", "n2"], res.stdout
    assert len({r[3] for r in ranks.values()}) == 1, res.stdout


def test_doc_mpirun_line_is_the_one_test_mpirun_runs():
    line = _block("bash", "mpirun").strip()
    assert line == "mpirun --allow-run-as-root -np 2 python examples/horovod_seed_002.py"
    assert os.path.exists(os.path.join(ROOT, "examples", "horovod_seed_002.py"))


def test_ci_runs_the_readme_test_command_verbatim():
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = re.search(r"Run the tests.*?```bash\n(.*?)\n```", readme, re.S).group(1)
    assert command.startswith("bash scripts/install-test-deps.sh && "), command
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert command in ci.splitlines(), ".ci/run must run the README's test command verbatim"
    assert "apt-get" not in ci, "system installs belong in scripts/install-test-deps.sh"
    assert os.access(os.path.join(ROOT, "scripts", "install-test-deps.sh"), os.X_OK)
