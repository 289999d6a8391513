"""``phalanx run`` inside a SLURM allocation (an ``salloc`` shell or an ``sbatch`` script): use it.

Inside a job but outside a step (SLURM_JOB_ID set, no SLURM_STEP_ID), ``phalanx run python
train.py`` reads the allocation and starts one agent per node through ``srun`` (not SSH)::

    salloc -N2 -n4 phalanx run python train.py
      SLURM_JOB_NODELIST=n[1-2]  SLURM_TASKS_PER_NODE=2(x2)   -> -np 4: n1 runs 2 workers, n2 runs 2
      srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=n1,n2 --input=all --kill-on-bad-exit=1 \\
           python -m phalanx.launcher.slurm node --plan '[["n1",2,"10.1.0.1"],["n2",2,"10.1.0.2"]]' … -- CMD
        node n1: TorchElastic agent, hosts the rendezvous on n1's address, ranks 0-1
        node n2: TorchElastic agent, joins it, ranks 2-3

* ``-np`` defaults to the allocation's task count; nodes are filled in order, so a smaller
  ``-np`` uses the first nodes only; more than the allocation holds is a one-line error.
* A node name that does not resolve is reached at SLURM's ``NodeAddr`` (``scontrol show node``).
* The job secret reaches every agent on srun's standard input (``--input=all``), which then
  stays open: closing it (Ctrl-C) stops every node's workers. SIGTERM and ``--preempt-signal``
  are srun's to pass on (preemption: the workers save and exit 85; see :func:`_supervise`).
* The agent step asks for the node's CPUs (``--cpus-per-task``, the fewest any planned node
  has) so that SLURM's CPU binding does not squeeze the workers onto one core; GPUs of the job
  are the step's by SLURM's default.
* ``--max-restarts N``: each node's agent restarts its workers after a failure and the others follow
  it into the new rendezvous (a group restart on every node), N times at most.
* ``--min-np/--max-np``: the in-process elastic supervisor over the allocation's nodes
  (:func:`elastic_options`): one ``srun --nodes=1 --ntasks=1 --overlap`` step per worker
  (:class:`SrunSteps`), the nodes' task counts as slots, a lost worker replaced on a node with a free slot.
* Workers see ``RANK``/``WORLD_SIZE`` as under any ``phalanx run``; the step's per-task SLURM
  variables (SLURM_PROCID, SLURM_NTASKS, …: they describe the agent, not the worker) are removed.

Example::

    from phalanx.launcher.slurm import allocation
    alloc = allocation()            # None outside a job, or inside a step (srun)
    alloc.job_id, alloc.nodes, alloc.tasks   # '17', ['n1', 'n2'], [2, 2]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping

from phalanx.launcher import secret as job_secret
from phalanx.launcher.forward import GRACE_S, preempt_signals, report_preempted
from phalanx.log import get_logger
from phalanx.preemption.signals import PREEMPTED_EXIT_CODE
from phalanx.runtime.env import slurm_batch_only
from phalanx.runtime.hostlist import expand_counts, expand_hostlist, node_addresses

__all__ = ["Allocation", "allocation", "plan_nodes", "srun_command", "launch_slurm", "node_main", "main",
           "SrunSteps", "elastic_options"]

log = get_logger(__name__)
_GRACE_S = 10.0
MODULE = "phalanx.launcher.slurm"
# What srun sets per task: true of the agent, false of the workers it starts.
_STEP_TASK_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_GTIDS",
                        "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASK_PID",
                        "SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK")


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The nodes of a SLURM job and the tasks it holds on each."""

    job_id: str
    nodes: list[str]
    tasks: list[int]
    cpus: list[int]

    @property
    def total(self) -> int:
        return sum(self.tasks)

    def describe(self) -> str:
        return f"SLURM job {self.job_id} ({len(self.nodes)} node(s) {','.join(self.nodes)}, {self.total} task(s))"


def allocation(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process runs in when it is outside any step (salloc shell, sbatch script).

    Raises ValueError when SLURM's variables cannot be read (the message names the variable).
    """
    env = os.environ if env is None else env
    if not slurm_batch_only(env):
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError(f"SLURM job {env['SLURM_JOB_ID']}: SLURM_JOB_NODELIST is not set; "
                         "run phalanx inside salloc/sbatch, or give the hosts with -H")
    nodes = expand_hostlist(nodelist)
    tasks = expand_counts(env.get("SLURM_TASKS_PER_NODE", "")) or [1] * len(nodes)
    cpus = expand_counts(env.get("SLURM_JOB_CPUS_PER_NODE", "")) or [0] * len(nodes)
    if len(tasks) != len(nodes):
        raise ValueError(f"SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')!r} lists {len(tasks)} node(s) "
                         f"but SLURM_JOB_NODELIST={nodelist!r} has {len(nodes)}")
    if len(cpus) != len(nodes):
        cpus = [0] * len(nodes)
    return Allocation(env["SLURM_JOB_ID"], nodes, tasks, cpus)


def plan_nodes(alloc: Allocation, np: int) -> list[tuple[str, int]]:
    """(node, workers) filling the allocation's nodes in order; ValueError when -np is too big."""
    if np > alloc.total:
        raise ValueError(f"-np {np} is more than the {alloc.total} task(s) of {alloc.describe()}; "
                         f"lower -np or ask salloc/sbatch for more (-n {np})")
    plan, left = [], np
    for node, slots in zip(alloc.nodes, alloc.tasks):
        if left <= 0:
            break
        plan.append((node, min(slots, left)))
        left -= plan[-1][1]
    return plan


def srun_command(alloc: Allocation, plan: list[tuple[str, int]], agent_options: list[str],
                 command: list[str], python: str | None = None) -> list[str]:
    """The ``srun`` line that starts one agent on each planned node."""
    addrs = node_addresses([n for n, _ in plan])
    table = [[n, k, addrs[n]] for n, k in plan]
    cpus = [c for (n, c) in zip(alloc.nodes, alloc.cpus) if c and n in dict(plan)]
    argv = ["srun", f"--nodes={len(plan)}", f"--ntasks={len(plan)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(n for n, _ in plan)}", "--input=all", "--kill-on-bad-exit=1",
            f"--job-name={os.environ.get('SLURM_JOB_NAME', 'phalanx')}"]
    if cpus:
        argv.append(f"--cpus-per-task={min(cpus)}")
    argv += [python or sys.executable, "-m", MODULE, "node", "--plan", json.dumps(table), *agent_options,
             "--", *command]
    return argv


def launch_slurm(alloc: Allocation, np: int, command: list[str], *, env: dict[str, str] | None = None,
                 network_interface: str | None = None, start_timeout: int = 60, port: int | None = None,
                 log_dir: str | None = None, ranks_filter: frozenset[int] | None = None,
                 max_restarts: int = 0) -> int:
    """Start ``command`` on ``np`` workers over the allocation's nodes; return the job's exit code."""
    plan = plan_nodes(alloc, np)
    if len({k for _, k in plan}) != 1:
        log.warning("nodes run different numbers of workers %s; hierarchical collectives fall back to flat",
                    [k for _, k in plan])
    options = ["--nnodes", str(len(plan)), "--run-id", uuid.uuid4().hex[:12], "--start-timeout", str(start_timeout),
               "--port", str(port or random.randint(20000, 40000))]
    if max_restarts:  # a failed worker: its node's agent restarts its group, the others follow (re-rendezvous)
        options += ["--max-restarts", str(max_restarts)]
    if log_dir:
        options += ["--log-dir", os.path.abspath(log_dir)]
    if ranks_filter is not None:
        options += ["--ranks-filter", ",".join(map(str, sorted(ranks_filter)))]
    if network_interface:
        options += ["--network-interface", network_interface]
    for k, v in (env or {}).items():
        options += ["--env", f"{k}={v}"]
    argv = srun_command(alloc, plan, options, command)
    log.info("%s: %s", alloc.describe(), " ".join(argv[:9]))
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    proc.stdin.write(job_secret.new_secret().decode() + "\n")
    proc.stdin.flush()
    pump = threading.Thread(target=_pump, args=(proc.stdout, sys.stdout), daemon=True)
    pump.start()
    return _supervise(proc, pump, preempt_signals((signal.SIGTERM,), {**os.environ, **(env or {})}))


class SrunSteps:
    """How the elastic supervisor reaches a node of the allocation (in place of SSH): one ``srun`` step
    per worker, ``srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap --input=all … sh -c LINE``.

    ``--overlap``: a replacement may start while SLURM still counts the lost worker's step. The
    step's per-task variables (SLURM_PROCID=0, SLURM_NTASKS=1) are unset for the worker.
    """

    def __init__(self, alloc: Allocation) -> None:
        self.alloc = alloc
        self.cpus = {n: c // max(k, 1) for n, c, k in zip(alloc.nodes, alloc.cpus, alloc.tasks) if c}

    def command(self, node: str, remote: str) -> list[str]:
        argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--input=all",
                f"--job-name={os.environ.get('SLURM_JOB_NAME', 'phalanx')}"]
        if self.cpus.get(node):
            argv.append(f"--cpus-per-task={self.cpus[node]}")
        unset = [f"--unset={k}" for k in _STEP_TASK_VARIABLES]
        return [*argv, "env", *unset, "sh", "-c", remote]


def elastic_options(alloc: Allocation, np: int) -> dict:
    """The Supervisor's keywords for ``--min-np/--max-np`` inside ``alloc``: its nodes with their task
    counts as slots, reached through srun, a failed worker replaced on a node with a free slot (up to
    --max-restarts). ValueError (one line) when -np is more than the allocation holds."""
    from phalanx.launcher.hosts import is_local, route_source

    plan_nodes(alloc, np)  # validates -np
    hosts: dict[str, int] = {}
    for node, slots in zip(alloc.nodes, alloc.tasks):
        hosts[node] = hosts.get(node, 0) + slots
    remote = [n for n in hosts if not is_local(n)]
    addr = None
    if remote:  # node names that do not resolve: SLURM's NodeAddr
        addr = route_source(node_addresses(remote[:1])[remote[0]])
    return {"hosts": hosts, "ssh": SrunSteps(alloc), "store_addr": addr, "replace_failed": True}


def _pump(stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(line if line.startswith("[") else f"[slurm] {line}")
        out.flush()
    stream.close()


def _supervise(proc: subprocess.Popen, pump: threading.Thread, preempt=(signal.SIGTERM,)) -> int:
    """Wait for srun. SIGINT stops every node. SIGTERM and the preempt signal are srun's to pass on
    (``scancel --full`` signals srun and the agents too): the agents forward them to their workers,
    which save and exit 85; this launcher waits (≤ GRACE_S) and exits with srun's status."""
    stop, got = threading.Event(), []

    def on_signal(signum, _frame):
        stop.set()

    def on_preempt(signum, _frame):
        if not got:
            print(f"phalanx: received {signal.Signals(signum).name}; srun passes it to every node's workers, "
                  f"waiting up to {GRACE_S:.0f} s for their preemption checkpoint", file=sys.stderr, flush=True)
        got.append((signal.Signals(signum), time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)  # srun forwards it to the agents (a repeat is ignored there)

    previous = {}
    for sig, handler in ((signal.SIGINT, on_signal), *((s, on_preempt) for s in preempt)):
        with contextlib.suppress(ValueError):  # not the main thread
            previous[sig] = signal.signal(sig, handler)
    try:
        while proc.poll() is None and not stop.is_set():
            if got and time.monotonic() - got[0][1] > GRACE_S:
                print(f"phalanx: the workers did not finish their preemption checkpoint within {GRACE_S:.0f} s; "
                      "stopping them", file=sys.stderr, flush=True)
                stop.set()
            stop.wait(0.1)
        if stop.is_set() and not got:
            print("phalanx: interrupted; stopping the workers on every node", file=sys.stderr, flush=True)
    finally:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.close()  # EOF: every agent stops its workers and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_GRACE_S)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        pump.join(2)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop.is_set():
        return 130 if not got else 128 + int(got[0][0])
    if proc.returncode == PREEMPTED_EXIT_CODE:
        return report_preempted(got[0][0] if got else None)
    return proc.returncode


def node_main(argv: list[str]) -> int:
    """``node --plan JSON [agent options] -- CMD``: this node's agent (srun runs one per node)."""
    from phalanx.launcher.agent import agent_main

    if "--plan" not in argv or "--port" not in argv:
        print(f"usage: python -m {MODULE} node --plan JSON --port P … -- COMMAND (phalanx run starts this)",
              file=sys.stderr)
        return 2
    i = argv.index("--plan")
    table, rest = json.loads(argv[i + 1]), argv[:i] + argv[i + 2:]
    j = rest.index("--port")
    port, rest = rest[j + 1], rest[:j] + rest[j + 2:]
    me = os.environ.get("SLURMD_NODENAME", "")
    rows = {name: (k, addr) for name, k, addr in table}
    if me not in rows:
        print(f"phalanx node: this node {me!r} is not in the plan {list(rows)}", file=sys.stderr)
        return 2
    nproc, addr = rows[me]
    first = table[0]
    for k in _STEP_TASK_VARIABLES:
        os.environ.pop(k, None)
    options = ["--rdzv", f"{first[2]}:{port}", "--nproc", str(nproc), "--local-addr", addr]
    if me == first[0]:
        options.append("--is-host")
    cut = rest.index("--") if "--" in rest else len(rest)
    return agent_main(rest[:cut] + options + rest[cut:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["node"]:
        return node_main(argv[1:])
    print(f"usage: python -m {MODULE} node … (phalanx run starts this inside a SLURM allocation)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
