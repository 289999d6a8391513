"""Start and supervise the workers of this host, on TorchElastic's agent.

The agent (``torch.distributed.launcher.elastic_launch``) does rendezvous on a
c10d TCPStore, sets RANK / WORLD_SIZE / LOCAL_RANK / … for each worker, watches
them every 100 ms and, when one exits non-zero, stops the others. phalanx adds
what a user of ``horovodrun``/``mpirun`` expects around it:

* every output line carries its rank: ``[1]: loss 0.31``;
* a failure report names the rank, its exit code or signal and the last lines of
  its stderr, then the launcher exits non-zero;
* no process is left behind: the launcher is a child subreaper, so workers'
  own children are re-parented to it and killed at the end, and each worker
  receives SIGKILL if the launcher itself dies (see ``_exec.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import logging
import os
import signal
import sys
import tempfile
import time
import uuid

__all__ = ["LaunchSpec", "launch", "kill_descendants"]

_PR_SET_CHILD_SUBREAPER = 36
_EXEC_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_exec.py")

log = logging.getLogger("phalanx.launcher")


@dataclasses.dataclass
class LaunchSpec:
    """How to start this host's share of a job."""

    nproc_per_node: int
    min_nodes: int = 1
    max_nodes: int = 1
    rdzv_endpoint: str = "127.0.0.1:0"
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])
    max_restarts: int = 0
    start_timeout_s: int = 60
    log_dir: str | None = None
    local_addr: str | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    rdzv_extra: dict[str, object] = dataclasses.field(default_factory=dict)  # e.g. {"is_host": True}
    monitor_interval_s: float = 0.1


def _become_subreaper() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                text = f.read()
        except OSError:
            continue
        # the command name is in parentheses and may contain spaces
        pid = int(text[: text.index(" ")])
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(pid)
    return children


def kill_descendants(root: int | None = None) -> list[int]:
    """SIGKILL every descendant of ``root`` (default: this process). Returns their pids."""
    root = os.getpid() if root is None else root
    children = _children_map()
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return found


def _stderr_tail(log_dir: str, local_rank: int, lines: int = 15) -> str:
    paths = sorted(glob.glob(os.path.join(log_dir, "**", str(local_rank), "stderr.log"), recursive=True))
    if not paths:
        return ""
    with open(paths[-1], errors="replace") as f:
        tail = f.read().splitlines()[-lines:]
    return "\n".join("    " + line for line in tail)


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def launch(spec: LaunchSpec, command: list[str]) -> int:
    """Run ``command`` on ``spec.nproc_per_node`` local workers; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if spec.nproc_per_node < 1:
        raise ValueError(f"-np must be at least 1, got {spec.nproc_per_node}")
    if not command:
        raise ValueError("no command given: phalanx run -np 2 python train.py")
    _become_subreaper()
    log_dir = spec.log_dir or tempfile.mkdtemp(prefix="phalanx-logs-")
    threads = max(1, (os.cpu_count() or 1) // spec.nproc_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.update(spec.env)
    os.environ["PHALANX_LAUNCHER"] = "run"
    store, endpoint = _host_rendezvous_store(spec)  # kept alive for the whole launch
    config = LaunchConfig(
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"timeout": spec.start_timeout_s, "join_timeout": spec.start_timeout_s, **spec.rdzv_extra},
        max_restarts=spec.max_restarts,
        monitor_interval=spec.monitor_interval_s,
        start_method="spawn",
        log_line_prefix_template="[${rank}]: ",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        local_addr=spec.local_addr,
    )
    # The agent logs its own progress at INFO/WARNING; users want the workers' lines.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    started = time.monotonic()
    try:
        elastic_launch(config, sys.executable)(_EXEC_SHIM, *command)
        return 0
    except ChildFailedError as err:
        return _report_failure(err, log_dir)
    except SignalException as err:
        print(f"phalanx: received {err.sigval.name}; stopped every worker", file=sys.stderr)
        return 128 + int(err.sigval)
    finally:
        del store
        leftovers = kill_descendants()
        if leftovers:
            log.debug("killed %d leftover processes after %.1fs", len(leftovers), time.monotonic() - started)


def _host_rendezvous_store(spec: LaunchSpec):
    """When this agent hosts the rendezvous, open its store on the endpoint's address only.

    TorchElastic's c10d backend opens its TCPStore with ``multi_tenant=True``, so it
    reuses this server (same port, same process) instead of binding every interface; the
    workers' process-group store is that same server. Returns (store or None, endpoint).
    """
    import datetime

    from phalanx.runtime import bound_tcp_store

    timeout = datetime.timedelta(seconds=max(60, spec.start_timeout_s))
    _bind_shared_worker_store(timeout)
    host, _, port = spec.rdzv_endpoint.rpartition(":")
    if not spec.rdzv_extra.get("is_host", True) or not host:
        return None, spec.rdzv_endpoint
    store = bound_tcp_store(host.strip("[]"), int(port or 0), multi_tenant=True, timeout=timeout)
    return store, f"{host}:{store.port}"


def _bind_shared_worker_store(timeout) -> None:
    """The store TorchElastic shares with the workers, bound to the node's address only.

    The rendezvous handler opens that server through one small private method with a
    fixed job (``TCPStore(addr, 0, is_master=True, multi_tenant=True)``); this agent
    process overrides it to do the same on one address. Where a torch release lacks
    the method, nothing changes (the store then listens on every address, torch's way).
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from phalanx.runtime import bound_tcp_store

    handler = getattr(dynamic_rendezvous, "DynamicRendezvousHandler", None)
    if handler is not None and hasattr(handler, "_create_tcp_store_server"):
        handler._create_tcp_store_server = (
            lambda self, master_addr, master_port: bound_tcp_store(master_addr, master_port, multi_tenant=True,
                                                                   timeout=timeout))


def _report_failure(err, log_dir: str) -> int:
    failures = err.failures  # global rank -> ProcessFailure
    root_rank, root = min(failures.items(), key=lambda kv: kv[1].timestamp)
    lines = [f"phalanx: rank {root_rank} (local rank {root.local_rank}, pid {root.pid}) failed: "
             f"{_describe_exit(root.exitcode)}"]
    tail = _stderr_tail(log_dir, root.local_rank)
    if tail:
        lines.append(f"  last lines of rank {root_rank}'s stderr:\n{tail}")
    others = sorted(r for r in failures if r != root_rank)
    if others:
        lines.append(f"phalanx: stopped the other ranks {others} after that failure")
    print("\n".join(lines), file=sys.stderr, flush=True)
    code = root.exitcode
    return code if code > 0 else 128 + (-code if code < 0 else 1)
