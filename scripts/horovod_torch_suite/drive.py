"""Run Horovod's own PyTorch suite (test/parallel/test_torch.py) on 2 ranks against phalanx, by hand.

Setup (Horovod's files are Apache-2.0; they are fetched, not kept here)::

    git clone https://github.com/horovod/horovod /tmp/horovod      # 0.28.1's tree was used
    cp /tmp/horovod/test/parallel/test_torch.py .
    python drive.py --common /tmp/horovod/test/utils/common.py > common.py     # both ignored by git

Run (from this folder; writes OUT_JSON with every test's outcome, and OUT_JSON.attemptN.log)::

    python drive.py CODE_DIR OUT_JSON [ENV=VALUE ...]
    HVD_TESTS="-k join" python drive.py CODE_DIR OUT_JSON     # a subset (extra pytest arguments)

``horovod/`` maps ``horovod.torch`` to ``phalanx.horovod.torch``. Each attempt runs the tests not
yet decided under ``phalanx run -np 2 pytest -x``: a test that fails on either rank leaves the
ranks out of step for the tests after it (Horovod's own CI has the same coupling), so the run
stops there, records it, and starts again past it. A test that aborts its process is CRASHED,
one that outlives pytest-timeout's 90 s is HUNG. Collectives time out after 20 s
(PHALANX_TIMEOUT). The helper ``common_helpers`` is ``../horovod_tf_suite/drive.py``'s.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "horovod_tf_suite"))

from drive import common_helpers  # noqa: E402

TEST = r"(test_torch\.py::\w+::\w+)"
BAD = ("FAILED", "ERROR")


def outcomes(text: str, rank: int):
    """This rank's outcomes in run order (``-v`` lines, then the ``-rA`` summary) and the test it
    was in when the output ended (None if it had finished that test)."""
    order, seen, started = [], {}, None
    for line in text.splitlines():
        m = re.match(rf"\[{rank}\]: {TEST}(?: (PASSED|FAILED|SKIPPED|ERROR))?", line)
        if m:
            name, res = m.group(1), m.group(2)
            if name not in seen:
                order.append(name)
            if res:
                # a teardown ERROR follows the call's PASSED on a line of its own: keep the worse
                seen[name] = res if seen.get(name) not in BAD else seen[name]
                started = None
            else:
                started = name
            continue
        m = re.match(rf"\[{rank}\]: (PASSED|FAILED|ERROR|SKIPPED) {TEST}", line)
        if m:
            name, res = m.group(2), m.group(1)
            if name not in seen:
                order.append(name)
            if seen.get(name) not in BAD:
                seen[name] = res
    return order, seen, started


def junit(path: str) -> dict:
    """A rank's outcomes from its JUnit XML (written when pytest ends; absent after a crash or hang)."""
    if not os.path.exists(path):
        return {}
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"test_torch.py::{case.get('classname').split('.')[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        out[name] = "FAILED" if tags & {"failure", "error"} else "SKIPPED" if "skipped" in tags else "PASSED"
    return out


def main():
    if sys.argv[1] == "--common":
        print(common_helpers(sys.argv[2], ("mpi_env_rank_and_size", "skip_or_fail_gpu_test", "temppath")))
        return
    code, out_json = sys.argv[1], sys.argv[2]
    extra = dict(a.split("=", 1) for a in sys.argv[3:])
    env = {**os.environ, "PYTHONPATH": f"{code}:{HERE}", "PHALANX_TIMEOUT": "20", **extra}
    # the test ids, listed once: each attempt names the undecided ones (--deselect matches prefixes)
    listed = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                             "test_torch.py", *shlex.split(os.environ.get("HVD_TESTS", ""))],
                            cwd=HERE, env=env, capture_output=True, text=True, timeout=600).stdout
    ids = [line for line in listed.splitlines() if re.fullmatch(TEST, line)]
    results = {}
    for attempt in range(80):
        remaining = " ".join(i for i in ids if i not in results)
        if not remaining:
            break
        xml = f"{os.path.abspath(out_json)}.attempt{attempt}.rank"
        inner = ("HOROVOD_RANK=$RANK HOROVOD_SIZE=$WORLD_SIZE exec python -m pytest -p no:cacheprovider -v -rA -x "
                 f"--timeout=90 --timeout-method=thread --junitxml={xml}$RANK.xml {remaining}")
        proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", "2", "sh", "-c", inner], cwd=HERE,
                              env=env, capture_output=True, text=True, timeout=3000)
        text = proc.stdout + proc.stderr
        with open(f"{out_json}.attempt{attempt}.log", "w") as f:
            f.write(text)
        ranks = [outcomes(text, r) for r in (0, 1)]
        order = []
        for r, (ran, seen, _) in enumerate(ranks):
            seen.update(junit(f"{xml}{r}.xml"))  # whole records (the -v lines of two ranks interleave)
            order += [n for n in [*ran, *seen] if n not in order]
        before = len(results)
        for name in order:
            got = [seen.get(name) for _, seen, _ in ranks]
            if any(g in BAD for g in got):
                results[name] = "FAILED"
                break  # the tests after it ran with the ranks out of step: run them again
            if all(g in ("PASSED", "SKIPPED") for g in got):
                results[name] = got[0]
        else:
            started = ranks[0][2] or ranks[1][2]
            if started and started not in results and proc.returncode != 0:
                results[started] = "HUNG" if "+ Timeout +" in text else "CRASHED"
        if len(results) == before:
            break
        print(f"attempt {attempt}: {len(results)} decided", flush=True)
    counts = {}
    for v in results.values():
        counts[v] = counts.get(v, 0) + 1
    with open(out_json, "w") as f:
        json.dump({"counts": counts, "results": results}, f, indent=1)
    print(counts)


if __name__ == "__main__":
    main()
