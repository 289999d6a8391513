"""The job tests/services/test_preempt_restart.py runs under ``phalanx run -np 2 --max-restarts 1``.

Both ranks watch for preemption (``px.preemption.watch()``), so both catch SIGTERM.

* attempt 0: at step 3 rank 0 blocks in a wait recorded as collective ``allreduce 'stuck'``
  (a store wait on a key nobody sets: like a gloo receive on a dead peer, a C++ wait that a
  signal does not end), then rank 1 fails (exit 1). The agent stops the group with SIGTERM:
  rank 0's guard must end it at once instead of the agent's SIGKILL 30 s later.
* attempt 1: the group restart. At step 2 rank 0 blocks the same way (on a key rank 1 sets
  later) and tells the test, which sends SIGTERM to ``phalanx run``: a marked preemption, so
  rank 0 must not be cut short although it is blocked for longer than the guard's grace; both
  ranks then agree, note their step and exit 85.

Notes go to OUT/events.jsonl (one JSON object per line, with the wall time).
"""

import datetime
import json
import os
import sys
import time

out = sys.argv[1]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with open(os.path.join(out, "events.jsonl"), "a") as f:  # the process started (before import torch: its
    f.write(json.dumps({"what": "start", "rank": int(os.environ["RANK"]), "attempt": attempt, "t": time.time()})
            + "\n")  # time depends on the machine's load, the agent's stop does not)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.preemption import guard  # noqa: E402
from phalanx.runtime.heartbeat import HEARTBEAT_STORE_ENV, RECORD  # noqa: E402


def note(what, **info):
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps({"what": what, "rank": px.rank(), "attempt": attempt, "t": time.time(), **info}) + "\n")


def store():
    host, _, port = os.environ[HEARTBEAT_STORE_ENV].rpartition(":")
    return dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=120))


def stuck(key, seconds):
    """Block in C++ (as a collective does) until ``key`` is set, recorded as the collective we wait in."""
    waited = time.monotonic()
    RECORD.blocking(RECORD.begin("allreduce", "stuck", ()), store().wait, [key], datetime.timedelta(seconds=seconds))
    return time.monotonic() - waited


px.init()
x = torch.ones(4)
with px.preemption.watch() as preempt:
    for step in range(8):
        px.allreduce(x)
        if step == 0:
            note("first_step")
        if attempt == 0 and step == 3:
            if px.rank() == 0:
                note("blocking")
                stuck(f"never.{os.getpid()}", 120)
                note("unblocked")  # the test fails on this: the guard should have ended us
            else:
                time.sleep(1.0)  # rank 0 is blocked by now
                note("peer_failed")
                os._exit(1)
        if attempt == 1 and step == 2:
            if px.rank() == 0:
                open(os.path.join(out, "waiting"), "w").close()
                note("preempt_blocked", waited=stuck(f"go.{attempt}", 120))
            else:
                deadline = time.monotonic() + 120
                while preempt.local_flag() == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)  # the forwarded SIGTERM
                time.sleep(guard.GRACE_S + 2)  # rank 0 stays blocked past the guard's grace
                store().set(f"go.{attempt}", "1")
        if preempt.requested():
            note("preempted", step=step)
            preempt.finish(None)
note("finished")
