"""Run Horovod's own TF test files on 2 ranks against phalanx, by hand (not part of the test suite).

Setup (Horovod's files are Apache-2.0; they are fetched, not kept here)::

    git clone https://github.com/horovod/horovod /tmp/horovod      # 0.28.1's tree was used
    cp /tmp/horovod/test/parallel/{test_tensorflow.py,test_tensorflow2_keras.py,base_test_tensorflow.py} .
    mkdir -p utils && python drive.py --common /tmp/horovod/test/utils/common.py > utils/common.py
    sed -i 's|^sys.path.append.*utils.*$|sys.path.append(os.path.join(os.path.dirname(__file__), "utils"))|' \\
        test_tensorflow.py

Run (from this folder; writes OUT_JSON with every test's outcome and OUT_JSON.attemptN.log)::

    python drive.py CODE_DIR OUT_JSON [ENV=VALUE ...]          # e.g. TF_USE_LEGACY_KERAS=1
    HVD_FILES=test_tensorflow2_keras.py python drive.py ...       # one file
    HVD_DESELECT="test_tensorflow.py::TensorFlowTests::test_x ..." python drive.py ...   # leave tests out

A test that times out on one rank only (pytest-timeout) leaves the two ranks in different tests, and
every later test of that run fails on both; leave a known time-out out with ``HVD_DESELECT`` and
count it as failed by hand.

``horovod/`` maps ``horovod.tensorflow``, ``horovod.tensorflow.keras`` and ``horovod.keras`` to
phalanx's modules; ``parameterized.py`` and ``mock.py`` stand in for two test dependencies;
``sitecustomize.py`` hides triton (a baseline without phalanx's own guard would abort). A test
that aborts its process is recorded as CRASHED and the run restarts past it.
"""

import json
import os
import re
import subprocess
import sys


def common_helpers(path, names=("mpi_env_rank_and_size", "skip_or_fail_gpu_test")):
    """The helpers of Horovod's test/utils/common.py that a test file imports (default: test_tensorflow.py's)."""
    src = open(path).read()
    keep = [re.search(rf"^(@contextlib.contextmanager\n)?def {n}\(.*?(?=^def |^@|\Z)", src, re.S | re.M).group(0)
            for n in names]
    return ('"""From Horovod test/utils/common.py (Apache-2.0, Uber)."""\nimport contextlib\nimport os\n'
            'import tempfile\n\n\n' + "\n\n".join(keep))


def main():
    if sys.argv[1] == "--common":
        print(common_helpers(sys.argv[2]))
        return
    code, out_json = sys.argv[1], sys.argv[2]
    extra = dict(a.split("=", 1) for a in sys.argv[3:])
    here = os.path.dirname(os.path.abspath(__file__))
    files = os.environ.get("HVD_FILES", "test_tensorflow.py test_tensorflow2_keras.py").split()
    results, subfailed = {}, set()
    env = {**os.environ, "PYTHONPATH": f"{code}:{here}", "PHALANX_TIMEOUT": "20", **extra}
    for attempt in range(40):
        deselect = " ".join(f"--deselect {n}" for n in [*results, *os.environ.get("HVD_DESELECT", "").split()])
        inner = ("HOROVOD_RANK=$RANK HOROVOD_SIZE=$WORLD_SIZE exec python -m pytest -p no:cacheprovider -v -rA "
                 f"--timeout=90 {' '.join(files)} {deselect}")
        proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", "sh", "-c", inner], cwd=here,
                              env=env, capture_output=True, text=True, timeout=3000)
        text = proc.stdout + proc.stderr
        open(f"{out_json}.attempt{attempt}.log", "w").write(text)
        started = None
        for line in text.splitlines():
            if not line.startswith("[0]: "):
                continue
            for m in re.finditer(r"SUBFAIL\w*\[[^\]]*\] (test_\S+::\S+::\S+)", line):
                subfailed.add(m.group(1))
            m = re.match(r"\[0\]: (test_\S+::\S+::\S+)(?: (PASSED|FAILED|SKIPPED|ERROR))?", line)
            if m:
                if m.group(2):
                    results[m.group(1)], started = m.group(2), None
                else:
                    started = m.group(1)
        # pytest's -rA summary: one complete line per outcome (two ranks' progress lines interleave)
        for m in re.finditer(r"^\[0\]: (PASSED|FAILED|ERROR) (test_\S+::\S+::\S+)", text, re.M):
            results[m.group(2)] = m.group(1)
        if "Fatal Python" not in text:
            break
        if started:
            results[started] = "CRASHED"
    for name in subfailed:
        if results.get(name) == "PASSED":
            results[name] = "FAILED"
    counts = {}
    for v in results.values():
        counts[v] = counts.get(v, 0) + 1
    json.dump({"counts": counts, "results": results}, open(out_json, "w"), indent=1)
    print(counts)


if __name__ == "__main__":
    main()
