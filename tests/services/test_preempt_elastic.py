"""Preemption of an in-process elastic job: SIGTERM to `phalanx run --min-np 1 --max-np 2` is forwarded,
every member saves the same commit and exits 85, phalanx run exits 85; the same command again
(`--resume-from DIR` on both launches: the documented path) resumes and ends bitwise equal to an
uninterrupted run (tests/jobs/elastic_job.py PREEMPT_JOB, reference in one process). Two launches shared
by the checks below."""

import json
import os
import signal
import subprocess
import sys
import time

import elastic_job
import pytest
import torch

from phalanx.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.ranks

TOTAL = 8


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("preempt_elastic")
    script = out / "job.py"
    script.write_text(elastic_job.PREEMPT_JOB)
    cmd = [sys.executable, "-m", "phalanx", "run", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--resume-from", str(out / "ckpt"), "--timeout", "30", sys.executable, str(script), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(cmd + ["first", str(TOTAL)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    deadline = time.monotonic() + 240
    while not (out / "waiting").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if first.poll() is None:
        first.send_signal(signal.SIGTERM)  # to phalanx run only: it must forward it, not stop the workers
    stdout, stderr = first.communicate(timeout=240)
    second = subprocess.run(cmd + ["resume", str(TOTAL)], capture_output=True, text=True, timeout=240, env=env)
    return {"out": out, "first": (first.returncode, stdout, stderr), "second": second}


def test_sigterm_is_forwarded_and_the_job_exits_85(job):
    code, stdout, stderr = job["first"]
    report = (stdout + stderr)[-4000:]
    assert code == PREEMPTED_EXIT_CODE, report
    assert "received SIGTERM; forwarded to 2 worker(s)" in stderr, report
    assert "preempted by SIGTERM" in stderr and "failed" not in stderr, report  # no member counted as lost


def test_every_member_saved_the_same_commit(job):
    out = job["out"]
    stops = [json.loads((out / f"stop.{r}.json").read_text()) for r in (0, 1)]
    assert stops[0] == stops[1] and stops[0]["code"] == PREEMPTED_EXIT_CODE, stops
    assert 3 <= stops[0]["step"] < TOTAL and os.path.dirname(stops[0]["path"]) == str(out / "ckpt"), stops


def test_relaunch_resumes_bitwise_equal(job):
    second, out = job["second"], job["out"]
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "resumed from the last commit" in second.stdout + second.stderr
    ref = elastic_job.preempt_reference(TOTAL)
    for r in (0, 1):
        params = torch.load(out / f"params.{r}.pt", weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(ref, params, strict=True)), r
