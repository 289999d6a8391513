"""The prepared GPU run (benchmarks/gpu/run.sh) as a dry run on the CPU, so that it cannot rot
between the sessions that are lent a GPU: every step runs (tiny sizes, gloo, seconds), ends with
status 0, and writes its JSON lines; the checks that have a verdict pass."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("correctness", "amp", "zero_memory", "overlap", "launcher", "overhead", "codecs", "variants", "codec_profile",
         "fused_add", "titan_step")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry-run")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PHALANX_TEST_DEVICE", None)
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "run.sh"), "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=280, env=env)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return p, rows, out


def test_every_step_ran_and_ended_well(dry_run):
    p, rows, out = dry_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ends = {r["name"]: r for r in rows if r["step"] == "run"}
    assert sorted(ends) == sorted(STEPS), ends
    for name, end in ends.items():
        assert end["rc"] == 0 and not end["timed_out"], (name, end, p.stdout[-3000:])
    assert (out / "logs.tar.gz").stat().st_size > 0


def test_each_step_wrote_its_results_and_the_verdicts_pass(dry_run):
    _, rows, _ = dry_run
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    for step in STEPS:
        assert by_step.get(step), f"step {step} wrote no result line"
    errors = [r for r in rows if r.get("error") or r.get("errors")]
    assert not errors, errors
    failed = [r for r in rows if r.get("ok") is False]
    assert not failed, failed
    assert "correctness_failure" not in by_step, by_step.get("correctness_failure")
    machine = by_step["machine"][0]
    assert machine["device_kind"] == "cpu" and machine["torch"]


def test_a_wrong_argument_is_one_line():
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu", "run.sh"), "--device", "tpu"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stderr.strip() == "run.sh: --device tpu; accepted: cpu | cuda", p.stderr
