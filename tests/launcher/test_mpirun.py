"""Jobs started by Open MPI's ``mpirun``: seed 002's Horovod script as written, and rank 0's address over MPI.

Needs ``mpirun`` (apt-get install openmpi-bin; scripts/install-test-deps.sh) and, for the
across-hosts check, mpi4py (the ``mpi`` extra); skipped with the reason otherwise. The
"no mpi4py" error is checked anywhere.
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import phalanx.runtime.mpi as runtime_mpi
from phalanx.runtime import PhalanxRuntimeError, detect_environment

pytestmark = pytest.mark.cluster

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "horovod_seed_002.py")
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="mpirun not installed (apt-get install openmpi-bin)")
needs_mpi4py = pytest.mark.skipif(not runtime_mpi.mpi4py_available(),
                                  reason="mpi4py not installed (pip install 'phalanx[mpi]')")


def _mpirun(np, *argv, timeout=300):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np), *argv]
    env = {**os.environ, "OMPI_MCA_btl": "self,tcp"}  # no shared-memory transport probing in containers
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@needs_mpirun
def test_mpirun_runs_seed_002_horovod_script_and_replicas_agree(tmp_path):
    # The example unchanged, run as `mpirun -np 2 python examples/horovod_seed_002.py` would; the
    # wrapper only saves each rank's model after it so that the replicas can be compared.
    wrapper = tmp_path / "run_example.py"
    wrapper.write_text(textwrap.dedent(f'''
        import runpy, sys, torch
        sys.argv = [{EXAMPLE!r}]
        g = runpy.run_path({EXAMPLE!r}, run_name="__main__")
        torch.save(g["model"].state_dict(), "{tmp_path}/rank%d.pt" % g["hvd"].rank())
    '''))
    res = _mpirun(2, sys.executable, str(wrapper))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in res.stdout.splitlines() if line.startswith("Epoch")]
    assert len(losses) == 20 and losses[-1] < losses[0] * 0.8, res.stdout[-2000:]  # it learns
    accuracy = float(res.stdout.split("test accuracy")[1].split()[0])
    assert accuracy > 0.5, res.stdout[-500:]  # ten classes: chance is 0.1
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a), "replicas differ after training under mpirun"


ACROSS = textwrap.dedent('''
    import socket, sys, torch, phalanx as px
    from phalanx.runtime.mpi import rank0_address
    topo = px.init()
    t = torch.tensor([float(topo.rank + 1)])
    torch.distributed.all_reduce(t)
    print(f"rank {topo.rank} cross {topo.cross_rank}/{topo.cross_size} addr {rank0_address(topo.size)} sum {t.item()}")
    px.shutdown()
''')


@needs_mpirun
@needs_mpi4py
def test_mpirun_across_hosts_needs_no_master_addr_with_mpi4py(tmp_path):
    # Two "hosts": each rank is told it is alone on its node, as mpirun says across two machines.
    script = tmp_path / "across.py"
    script.write_text(ACROSS)
    shell = (f"OMPI_COMM_WORLD_LOCAL_SIZE=1 OMPI_COMM_WORLD_LOCAL_RANK=0 "
             f"OMPI_COMM_WORLD_NODE_RANK=$OMPI_COMM_WORLD_RANK exec {sys.executable} {script}")
    env_before = os.environ.pop("MASTER_ADDR", None)
    try:
        res = _mpirun(2, "sh", "-c", shell, timeout=180)
    finally:
        if env_before is not None:
            os.environ["MASTER_ADDR"] = env_before
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    # mpirun forwards each rank's output as it comes: one rank's line may land inside another's
    lines = sorted(re.findall(r"rank \d cross \d/\d addr \S+? sum [\d.]+", res.stdout))
    host = socket.gethostname()
    assert lines == [f"rank 0 cross 0/2 addr {host} sum 3.0", f"rank 1 cross 1/2 addr {host} sum 3.0"], res.stdout


def test_mpirun_across_hosts_without_mpi4py_names_the_fix(monkeypatch):
    for k, v in {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                 "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(runtime_mpi, "mpi4py_available", lambda: False)
    with pytest.raises(PhalanxRuntimeError) as err:
        detect_environment()
    message = str(err.value)
    assert "\n" not in message and "pip install 'phalanx[mpi]'" in message and "-x MASTER_ADDR" in message
    monkeypatch.setenv("MASTER_ADDR", "h0")  # given by hand: used as it is, no MPI needed
    assert detect_environment().master_addr == "h0"
