"""Several scripts in one ``phalanx run`` job: Python, torch and phalanx start once for all of them.

``run_scripts(tmp_dir, scripts)`` runs each script in turn in the same ranks, each in a namespace of
its own (``runpy``) and with the job left between them (``phalanx.shutdown()``), so each must init on
its own, as when it runs alone. Every rank prints ``=== NAME`` before each script; the output is
split at those marks, per rank, into one text per script (the launcher's ``[r]: `` prefixes kept,
the marks dropped), so each test reads its own script's lines.
"""

import os
import re
import subprocess
import sys

RUNNER = """
import os, runpy, sys
import phalanx as px
for path in sys.argv[1:]:
    assert not px.is_initialized(), "a script left the job initialized for the next one"
    print("=== " + os.path.basename(path), flush=True)
    sys.argv = [path]  # as when it runs alone
    runpy.run_path(path, run_name="__main__")
    px.shutdown()
"""


def run_scripts(tmp_dir, scripts, np=2, timeout=420, **kw):
    """(the finished job, {script name: its output lines from every rank; None: lines of no rank})."""
    runner = os.path.join(str(tmp_dir), "run_scripts.py")
    with open(runner, "w") as f:
        f.write(RUNNER)
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-np", str(np), sys.executable, runner,
                           *map(str, scripts)], capture_output=True, text=True, timeout=timeout, **kw)
    sections, current = {}, {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\[(\d+)\]: (.*)$", line)
        if m and m.group(2).startswith("=== "):
            current[m.group(1)] = m.group(2)[4:]
        else:
            sections.setdefault(current.get(m.group(1)) if m else None, []).append(line)
    return proc, {name: "\n".join(lines) for name, lines in sections.items()}
