"""Horovod example scripts under ``phalanx run -np 2`` with only their import changed: seed 002's
training script and examples/horovod_metric_average.py (the documented import and Horovod's
metric_average). Both run in one job (scripts_job.py: one after the other in the same two processes,
each initialising on its own): Python, torch and phalanx start once; each test reads its own lines."""

import os
import re

import pytest
from scripts_job import run_scripts

pytestmark = pytest.mark.ranks

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
SCRIPTS = ("horovod_seed_002.py", "horovod_metric_average.py")


@pytest.fixture(scope="module")
def examples_job(tmp_path_factory):
    """(the finished job, {script: its output lines from every rank, prefixes kept})."""
    return run_scripts(tmp_path_factory.mktemp("horovod_examples"), [os.path.join(EXAMPLES, s) for s in SCRIPTS])


def test_seed_002_script_runs_with_only_the_import_changed(examples_job):
    proc, sections = examples_job
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = sections.get("horovod_seed_002.py", "")
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "Loss" in line]
    accuracy = float(out.rsplit("test accuracy", 1)[1].split()[0])
    assert losses[-1] < losses[0] - 0.3 and accuracy > 0.6, (losses, accuracy)  # chance is 0.1


def test_metric_average_example_averages_the_ranks_metrics_and_learns(examples_job):
    proc, sections = examples_job
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = sections.get("horovod_metric_average.py", "")
    local = [tuple(map(float, m)) for m in re.findall(r"local test loss (\S+) accuracy (\S+)", out)]
    average = re.findall(r"Average loss: (\S+), Accuracy: (\S+)", out)
    assert len(local) == 2 and len(average) == 1, proc.stdout
    loss, accuracy = map(float, average[0])
    assert abs(loss - (local[0][0] + local[1][0]) / 2) < 2e-6
    assert abs(accuracy - (local[0][1] + local[1][1]) / 2) < 2e-6
    assert accuracy > 0.8  # the task is linearly separable; chance is 0.5
