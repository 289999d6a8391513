"""examples/horovod_metric_average.py: the documented import and Horovod's metric_average, on 2 ranks."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ranks

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "horovod_metric_average.py")


def test_metric_average_example_averages_the_ranks_metrics_and_learns():
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", sys.executable, EXAMPLE],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    local = [tuple(map(float, m)) for m in re.findall(r"local test loss (\S+) accuracy (\S+)", proc.stdout)]
    average = re.findall(r"Average loss: (\S+), Accuracy: (\S+)", proc.stdout)
    assert len(local) == 2 and len(average) == 1, proc.stdout
    loss, accuracy = map(float, average[0])
    assert abs(loss - (local[0][0] + local[1][0]) / 2) < 2e-6
    assert abs(accuracy - (local[0][1] + local[1][1]) / 2) < 2e-6
    assert accuracy > 0.8  # the task is linearly separable; chance is 0.5
