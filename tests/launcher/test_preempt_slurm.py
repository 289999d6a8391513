"""Preemption on a real SLURM cluster (tests/jobs/slurm_cluster.py): docs/slurm.md's ``sbatch --requeue`` script
(``phalanx run`` as the batch step: one agent per node through srun), two ranks on two nodes, gets ``scancel --signal=USR1 --full`` mid-run; both ranks save one checkpoint at
the same step, rank 0 requeues the job (``scontrol requeue``), and the requeued run resumes with no
flag (``SLURM_RESTART_COUNT``) and ends with parameters bitwise equal to an uninterrupted run."""

import json
import os
import re
import sys
import time

import pytest
import torch
from slurm_cluster import needs_slurm, slurm  # noqa: F401  (slurm: the session's cluster fixture)

from phalanx.checkpoint import list_checkpoints

pytestmark = pytest.mark.cluster

JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "preempt_job.py")


def _job_state(slurm, job_id):  # noqa: F811
    out = slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState"), int(fields.get("Restarts", "0") or 0)


@needs_slurm
def test_usr1_checkpoints_requeues_and_resumes_bitwise_equal(slurm, tmp_path):  # noqa: F811
    out = tmp_path
    os.chmod(out, 0o755)
    # docs/slurm.md's preemption script, with this test's job, log and PYTHONPATH
    doc = open(os.path.join(os.path.dirname(JOB), "..", "..", "docs", "slurm.md")).read()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", doc, re.S) if b.startswith("#!/usr/bin/env bash")]
    line = "exec phalanx run --preempt-signal USR1 python train.py"
    assert line in block and "#SBATCH --requeue" in block
    block = block.replace("#SBATCH --requeue", f"#SBATCH --requeue\n#SBATCH -o {out}/slurm.out")
    script = out / "job.sh"
    script.write_text(block.replace(line, f"export PYTHONPATH={os.environ.get('PYTHONPATH', '')}\n"
                                          f"exec {sys.executable} -m phalanx run --preempt-signal USR1 "
                                          f"{sys.executable} {JOB} {out} slurm"))
    sub = slurm.run(["sbatch", "--parsable", str(script)])
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while not (out / "waiting").exists():
        assert time.monotonic() < deadline, f"job never reached the step: {(out / 'slurm.out').read_text()}"
        time.sleep(0.1)
    sig = slurm.run(["scancel", "--signal=USR1", "--full", job_id])
    assert sig.returncode == 0, sig.stderr
    while _job_state(slurm, job_id) != ("COMPLETED", 1):
        state = _job_state(slurm, job_id)
        assert state[0] not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), \
            f"{state}: {(out / 'slurm.out').read_text()[-3000:]} {slurm.log()}"
        assert time.monotonic() < deadline + 240, f"{state}: {(out / 'slurm.out').read_text()[-3000:]}"
        time.sleep(0.2)
    log = (out / "slurm.out").read_text()
    # the batch-level phalanx run caught USR1 and left it to srun (it used to die of it); its own exit
    # status is moot here: scontrol requeue ends the job's processes at once
    assert "phalanx: received SIGUSR1; srun passes it" in log, log[-3000:]
    stops = [json.loads((out / f"plain_stop.{r}.json").read_text()) for r in (0, 1)]
    assert stops[0]["step"] == stops[1]["step"] and stops[0]["path"] == stops[1]["path"], stops
    assert stops[0]["requeued"] and stops[0]["code"] == 85, stops  # rank 0 ran scontrol requeue
    assert list_checkpoints(str(out / "plain_ckpt"))[-1] == stops[0]["path"]
    assert re.search(rf"resumed from .*step-0+{stops[0]['step']}\b", log), log[-3000:]
    assert json.loads((out / "slurm_done.0.json").read_text())["restart"] == "1"
    ref, resumed = torch.load(out / "plain_ref.pt"), torch.load(out / "plain_resumed.pt")
    assert all(torch.equal(ref[k], resumed[k]) for k in ref)
