"""Elastic membership changes through `phalanx run` as a subprocess, in the shape of Horovod's elastic
integration tests (tests/elastic_job.py JOB): a discovery script whose output rank 0 changes at the end
of an epoch, failures scheduled on the workers of a host, both elastic APIs with gradients through
hvd.DistributedOptimizer / px.DataParallel. Checked: the world size of each epoch, the parameters
equal on every rank at the end, the exit status and the launcher's messages."""

import json
import os
import subprocess
import sys

import elastic_job
import torch


def _run(tmp_path, api, hosts, *flags, exits=None, mode="exception", epochs=3, batches=3, timeout=180):
    """Run JOB under `phalanx run FLAGS --host-discovery-script`; return (proc, log rows, report)."""
    (tmp_path / "job.py").write_text(elastic_job.JOB)
    (tmp_path / "hosts.txt").write_text(hosts[0])
    disc = tmp_path / "discover.sh"
    disc.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts.txt'}\n")
    disc.chmod(0o755)
    args = {"epochs": epochs, "batches": batches, "api": api, "hosts": {str(k): v for k, v in hosts.items()},
            "exits": exits or {}, "mode": mode}
    cmd = [sys.executable, "-m", "phalanx", "run", *flags, "--host-discovery-script", str(disc),
           "--discovery-interval", "0.2", "--timeout", "30", "python", str(tmp_path / "job.py"), str(tmp_path),
           json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = tmp_path / "log.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    report = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}\nlog:\n" + "\n".join(
        f"{r['what']} {r['wid']}@{r['host']} rank {r['rank']}/{r['size']} gen {r['gen']} e{r.get('epoch')}"
        f" b{r.get('batch')}" for r in rows)
    return proc, rows, report


def _sizes_per_epoch(rows):
    return [r["size"] for r in rows if r["what"] == "epoch"]


def _equal_params(tmp_path, n, report):
    params = [torch.load(tmp_path / f"params.{r}.pt", weights_only=True) for r in range(n)]
    for other in params[1:]:
        for a, b in zip(params[0], other):
            assert torch.equal(a, b), report  # bitwise: every replica the same
    assert all(torch.isfinite(p).all() for p in params[0]), report


def test_grow_2_to_4_with_distributed_optimizer(tmp_path):
    # the issue's crash: old ranks' learned bucket layout vs a newcomer's fresh one ("Received data
    # size doesn't match expected size"), then a hang; every rank now re-derives its engine at the re-form
    proc, rows, report = _run(tmp_path, "hvd", {0: "localhost:2\n", 1: "localhost:4\n"},
                              "-np", "2", "--min-np", "2", "--max-np", "4")
    assert proc.returncode == 0, report
    assert _sizes_per_epoch(rows) == [2, 4, 4], report
    assert len([r for r in rows if r["what"] == "end"]) == 4, report
    _equal_params(tmp_path, 4, report)
