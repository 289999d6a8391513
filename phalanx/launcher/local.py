"""Start and supervise the workers of this host, on TorchElastic's agent.

The agent (``torch.distributed.launcher.elastic_launch``) does rendezvous on a
c10d TCPStore, sets RANK / WORLD_SIZE / LOCAL_RANK / … for each worker, watches
them every 100 ms and, when one exits non-zero, stops the others. phalanx adds
what a user of ``horovodrun``/``mpirun`` expects around it:

* every output line carries its rank: ``[1]: loss 0.31``; ``ranks_filter`` shows
  only some ranks' output (torchrun's ``--local-ranks-filter``);
* logs only where asked: with ``log_dir`` each rank's output is kept in horovodrun's
  layout, ``log_dir/rank.N/stdout`` and ``stderr``; otherwise the agent's files live
  in a temporary folder that is removed at the end;
* a failure report names the root cause first: the rank that stalled (its heartbeat
  stopped, :mod:`~phalanx.launcher.stall`), left early with exit code 0 while the others
  still ran collectives, or failed first, with what it was doing; the other ranks'
  consequential timeouts and "connection closed" errors follow, one line each (their
  tracebacks were already shown once, live; the report repeats the root's last lines only
  when its output was filtered out), then the launcher exits non-zero;
* a stall watcher (:class:`~phalanx.launcher.stall.Watcher`) prints one block, with every
  live rank's Python stack, when a collective has waited ``--stall-warning`` seconds, and
  SIGKILLs a stopped (state T) worker at once when the job is ending;
* the job gets a secret (``PHALANX_SECRET_FILE``, 0600, removed at the end) unless one is
  given: the parameter server signs its frames with it;
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
import shutil
import signal
import sys
import tempfile
import time
import uuid

from phalanx.launcher import forward
from phalanx.launcher import secret as job_secret
from phalanx.launcher.file_tail import FileTails
from phalanx.launcher.stall import Watcher, describe_exit, lost_a_peer
from phalanx.preemption.guard import PREEMPT_MARK_ENV
from phalanx.runtime.heartbeat import HEARTBEAT_ENV, HEARTBEAT_STORE_ENV, STACK_DIR_ENV
from phalanx.settings import RuntimeSettings, var

__all__ = ["LaunchSpec", "launch", "kill_descendants", "rank_log_paths"]

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
    log_dir: str | None = None  # keep each rank's output here: log_dir/rank.N/stdout, stderr
    local_addr: str | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    rdzv_extra: dict[str, object] = dataclasses.field(default_factory=dict)  # e.g. {"is_host": True}
    monitor_interval_s: float = 0.1
    ranks_filter: frozenset[int] | None = None  # local ranks whose output the console shows (None: all)
    quiet_agent: bool = True  # TorchElastic's own INFO lines off (on at --log-level DEBUG)
    preempt_signals: tuple[int, ...] = (signal.SIGTERM,)  # forwarded to the workers, then exit 85 (forward.py)
    stall_warning_s: float = 60.0  # one collective waiting this long: print the stall block (Horovod's 60 s)
    stall_timeout_s: float | None = None  # a rank stalled this long is killed (None: left to --timeout)
    heartbeat_s: float = 1.0  # how often each rank publishes its heartbeat (runtime/heartbeat.py)


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


def rank_log_paths(log_dir: str, rank: int, attempt: int = 0) -> tuple[str, str]:
    """horovodrun's layout: ``log_dir/rank.N/stdout`` and ``stderr`` (``stdout.K`` after the K-th restart)."""
    suffix = f".{attempt}" if attempt else ""
    folder = os.path.join(log_dir, f"rank.{rank}")
    return os.path.join(folder, "stdout" + suffix), os.path.join(folder, "stderr" + suffix)


def _logs_specs(keep_dir: str | None, work_dir: str, ranks_filter):
    """A TorchElastic LogsSpecs writing rank output where :func:`rank_log_paths` says (error files in work_dir)."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RankLogs(LogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=work_dir, local_ranks_filter=ranks_filter)
            self.stderrs: dict[int, str] = {}  # local rank -> its stderr file (latest attempt)
            # the terminal's copy: phalanx's follower, whole lines only (file_tail.py says why not TorchElastic's tee)
            self.tails = FileTails()

        @property
        def root_log_dir(self) -> str:
            return work_dir

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            self.tails.finish()  # the previous attempt's workers have ended: the rest of their output
            dest = LogsDest()
            for local_rank, env in envs.items():
                rank, attempt = int(env.get("RANK", local_rank)), int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
                out, err = rank_log_paths(keep_dir or work_dir, rank, attempt)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                dest.stdouts[local_rank], dest.stderrs[local_rank] = out, err
                if ranks_filter is None or local_rank in ranks_filter:
                    self.tails.follow(out, f"[{rank}]: ", sys.stdout)
                    self.tails.follow(err, f"[{rank}]: ", sys.stderr)
                error_file = os.path.join(work_dir, f"error.{rank}.{attempt}.json")
                dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = error_file
                self.stderrs[local_rank] = err
            return dest

    return RankLogs()


def _stderr_tail(path: str | None, lines: int = 15) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        tail = f.read().splitlines()[-lines:]
    return "\n".join("    " + line for line in tail)


def launch(spec: LaunchSpec, command: list[str]) -> int:
    """Run ``command`` on ``spec.nproc_per_node`` local workers; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if spec.nproc_per_node < 1:
        raise ValueError(f"-np must be at least 1, got {spec.nproc_per_node}")
    if not command:
        raise ValueError("no command given: phalanx run -np 2 python train.py")
    _become_subreaper()
    work_dir = tempfile.mkdtemp(prefix="phalanx-logs-")  # the agent's files; removed at the end
    logs = _logs_specs(os.path.abspath(spec.log_dir) if spec.log_dir else None, work_dir, spec.ranks_filter)
    threads = max(1, (os.cpu_count() or 1) // spec.nproc_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.update(spec.env)
    os.environ[var("runtime.launcher")] = "run"
    stack_dir = os.path.join(work_dir, "stacks")
    os.makedirs(stack_dir)
    os.environ[STACK_DIR_ENV] = stack_dir
    ours = [STACK_DIR_ENV]  # variables this launch sets in its own environment, dropped at the end
    if not RuntimeSettings.one("secret_file"):
        os.environ[job_secret.SECRET_FILE_ENV] = job_secret.write_secret_file(job_secret.new_secret(), work_dir)
        ours.append(job_secret.SECRET_FILE_ENV)
    store, endpoint = _host_rendezvous_store(spec)  # kept alive for the whole launch
    preempt_signals = forward.preempt_signals(spec.preempt_signals, {**os.environ, **spec.env})
    watcher = None
    if store is not None:  # this agent hosts the store: its ranks' heartbeats arrive here
        os.environ.update({HEARTBEAT_ENV: str(spec.heartbeat_s), HEARTBEAT_STORE_ENV: endpoint})
        ours += [HEARTBEAT_ENV, HEARTBEAT_STORE_ENV]
        watcher = Watcher(store, range(spec.nproc_per_node * spec.max_nodes), stall_warning_s=spec.stall_warning_s,
                          stall_timeout_s=spec.stall_timeout_s, stack_dir=stack_dir)
        watcher.start()
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
        logs_specs=logs,
        local_addr=spec.local_addr,
        signals_to_handle=forward.torchelastic_signals(preempt_signals),
    )
    # The agent logs its own progress at INFO/WARNING; users want the workers' lines.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL if spec.quiet_agent else logging.INFO)
    log.info("starting %d worker(s) on this host: rendezvous %s, run id %s%s", spec.nproc_per_node, endpoint,
             spec.run_id, f", rank output kept in {spec.log_dir}/rank.N/" if spec.log_dir else "")
    started = time.monotonic()
    # a SIGTERM this launcher forwards is a preemption; one without this file is the agent stopping the group
    mark = os.environ[PREEMPT_MARK_ENV] = os.path.join(work_dir, "preempting")
    ours.append(PREEMPT_MARK_ENV)
    forwarding = forward.forward_preemption(preempt_signals, mark=mark)
    preempt = forwarding.__enter__()
    try:
        elastic_launch(config, sys.executable)(_EXEC_SHIM, *command)
        return 0
    except ChildFailedError as err:
        logs.tails.finish()  # the ranks' last lines before the failure's report
        if watcher is not None:
            watcher.stop()
        if forward.all_preempted(f.exitcode for f in err.failures.values()):  # the workers got the signal themselves
            return forward.report_preempted(preempt.signal)
        return _report_failure(err, logs.stderrs, spec.ranks_filter, watcher)
    except SignalException as err:
        logs.tails.finish()
        if preempt.preempted:
            return forward.report_preempted(err.sigval)
        print(f"phalanx: received {err.sigval.name}; stopped every worker", file=sys.stderr)
        return 128 + int(err.sigval)
    finally:
        logs.tails.close()
        forwarding.__exit__(None, None, None)
        if watcher is not None:
            watcher.stop()
        for name in ours:  # a later launch from this process (a group restart) makes its own
            os.environ.pop(name, None)
        del store
        leftovers = kill_descendants()
        if leftovers:
            log.debug("killed %d leftover processes after %.1fs", len(leftovers), time.monotonic() - started)
        shutil.rmtree(work_dir, ignore_errors=True)


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


def _is_consequence(failure, stderrs: dict[int, str]) -> bool:
    """SIGTERM (how the agent stops the rest of the group) or last words about a lost peer."""
    return failure.exitcode == -signal.SIGTERM or lost_a_peer(_stderr_tail(stderrs.get(failure.local_rank), 5))


def _root_cause(failures, stderrs: dict[int, str]):
    """The rank that failed first: not one that only saw a peer go away, then the earliest last write."""

    def key(item):
        rank, failure = item
        path = stderrs.get(failure.local_rank)
        written = os.path.getmtime(path) if path and os.path.exists(path) else float("inf")
        return (_is_consequence(failure, stderrs), failure.timestamp, written, rank)

    return min(failures.items(), key=key)


def _last_words(path: str | None) -> str:
    tail = [line.strip() for line in _stderr_tail(path, 8).splitlines() if line.strip()]
    return tail[-1][:400] if tail else ""  # room for an error's "how to fix" half


def _report_failure(err, stderrs: dict[int, str], ranks_filter, watcher: Watcher | None = None) -> int:
    failures = err.failures  # global rank -> ProcessFailure
    consequence = {r for r, f in failures.items() if _is_consequence(f, stderrs)}
    found = watcher.cause(failures, consequence) if watcher is not None else None
    if found is not None:  # the heartbeats name a rank that stalled or left: it comes first
        root_rank, first = found
        root = failures.get(root_rank)
    else:
        root_rank, root = _root_cause(failures, stderrs)
        words = _last_words(stderrs.get(root.local_rank))  # the error itself, where the rank wrote one
        first = (f"rank {root_rank} (local rank {root.local_rank}, pid {root.pid}) failed first: "
                 f"{describe_exit(root.exitcode)}" + (f": {words}" if words else ""))
    lines = ["phalanx: " + first]
    if root is not None and ranks_filter is not None and root.local_rank not in ranks_filter:
        tail = _stderr_tail(stderrs.get(root.local_rank))  # its traceback was not shown
        if tail:
            lines.append(f"  last lines of rank {root_rank}'s stderr:\n{tail}")
    others = sorted(r for r in failures if r != root_rank)
    if others:
        lines.append(f"phalanx: then, as a consequence, the other ranks {others} were stopped or failed:")
        for r in others:
            f, words = failures[r], _last_words(stderrs.get(failures[r].local_rank))
            lines.append(f"  rank {r} (pid {f.pid}): {describe_exit(f.exitcode)}" + (f": {words}" if words else ""))
    print("\n".join(lines), file=sys.stderr, flush=True)
    code = root.exitcode if root is not None else 1
    return code if code > 0 else 128 + (-code if code < 0 else 1)
