"""The Ray actor behind one rank of a :class:`~phalanx.ray.RayExecutor` job.

One actor per rank. The executor asks each actor where it runs (node, address, GPUs),
decides ranks host-major, then hands every actor the environment ``phalanx.init()``
reads (the same variables ``phalanx run`` sets: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
PHALANX_LAUNCHER) and the job secret. The actor itself never calls ``init()``: the
user's function does, as under ``phalanx run`` or ``horovod.ray``.

Example (what the executor does; users do not call these methods)::

    Worker = ray.remote(BaseWorker)
    w = Worker.remote()
    ray.get(w.setup.remote({"RANK": "0", ...}, secret_key, 0, 1))
    ray.get(w.execute.remote(lambda executable: 42))
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import time
import traceback
from typing import Any

from phalanx.launcher import secret as job_secret
from phalanx.log import get_logger
from phalanx.ray import ray_logger
from phalanx.ray.output import LineCount
from phalanx.settings import ElasticSettings

__all__ = ["BaseWorker", "WorkerFailure", "FunctionCall", "EXIT_KEY", "warn_if_ranks_niced", "elastic_visible_devices"]

log = get_logger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_WRITTEN = LineCount()  # the lines this process's rank-prefixed streams wrote (one pair of streams a process)
EXIT_KEY = "pxe/exit/"  # + worker id: the status an elastic worker ended its process with (Ray sees only a death)


class FunctionCall:
    """``fn(*args, **kwargs)`` ignoring the executable (what ``run`` sends to each actor)."""

    def __init__(self, fn, args=None, kwargs=None) -> None:
        self.fn, self.args, self.kwargs = fn, list(args or []), dict(kwargs or {})

    def __call__(self, _executable):
        return self.fn(*self.args, **self.kwargs)


class WorkerFailure(Exception):
    """What a rank raised, as text (its traceback) and, when it pickles, the exception itself."""

    def __init__(self, rank: int, text: str, exception: BaseException | None, at: float) -> None:
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank, self.text, self.exception, self.at = rank, text, exception, at

    def __reduce__(self):
        return (WorkerFailure, (self.rank, self.text, self.exception, self.at))


class _RankPrefixed(io.TextIOBase):
    """A text stream that starts every line with ``[rank]: `` (the prefix ``phalanx run`` prints).

    ``prefix``: a string, or a function giving it (an elastic worker's rank changes at a re-form).
    ``count``: where the complete lines written are counted (the driver waits for them to arrive)."""

    def __init__(self, stream, prefix: str, count: LineCount) -> None:
        self._stream, self._prefix, self._at_line_start, self._count = stream, prefix, True, count

    def write(self, text: str) -> int:
        self._count.add(text)
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(self._prefix() if callable(self._prefix) else self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return False


def _elastic_prefix() -> str:
    """``[rank]: `` once admitted to a generation (the rank of the latest), ``[w3]: `` while joining."""
    rank = os.environ.get("RANK")
    if ElasticSettings.one("join") or rank is None:
        return f"[{ElasticSettings.one('worker_id')}]: "
    return f"[{rank}]: "


def _record_exits(store_addr: str, wid: str) -> None:
    """Make ``os._exit(code)`` (how an elastic worker leaves: shrunk out, the job done, a failed
    re-form) first write ``code`` under EXIT_KEY+wid on the job's store, for the driver to read."""
    import datetime

    import torch.distributed as dist

    real_exit = os._exit
    host, _, port = store_addr.rpartition(":")

    def exit_recorded(code: int) -> None:
        try:
            store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=5))
            store.set(EXIT_KEY + wid, str(code))
        except Exception:  # noqa: BLE001 - the driver then reports a plain death
            pass
        real_exit(code)

    os._exit = exit_recorded


def _come_to_niceness(nice: int | None) -> int:
    """Lower this thread's niceness to ``nice`` where allowed; the niceness it then has.

    On Linux the niceness belongs to the thread, and threads started later inherit it: the
    rank's work (the task thread, gloo's and torch's threads) moves, Ray's own threads stay."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if nice is not None and nice < now:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except PermissionError:  # an unprivileged user may only raise it: the driver says what to do
            pass
        now = os.getpriority(os.PRIO_PROCESS, 0)
    return now


def _interface_address(names) -> tuple[str, str] | None:
    """(interface, IPv4 address) of the first of ``names`` this node has, or None."""
    import psutil  # a dependency of ray

    addrs = psutil.net_if_addrs()
    for name in names:
        for a in addrs.get(name, ()):
            if a.family == socket.AF_INET:
                return name, a.address
    return None


def elastic_visible_devices(own: list[str], node_gpus: int, local_rank: int) -> tuple[str, int]:
    """An elastic actor's CUDA_VISIBLE_DEVICES and the index of its own first GPU in it.

    The actor sees every GPU of its node (as horovod.ray's elastic executor shows ``0..local_size-1``,
    so peers can use CUDA IPC), ordered so that the first GPU Ray gave it (``own``, Ray's ids on the
    node) sits at index ``local_rank`` when the node has that many: a script's
    ``torch.cuda.set_device(hvd.local_rank())`` then computes on the GPU Ray reserved for it, not on
    a neighbour's.

    Example::

        elastic_visible_devices(["2"], 4, 1)   # ("0,2,1,3", 1)
    """
    if not own:
        raise ValueError("elastic_visible_devices: Ray gave this actor no GPU (use_gpu needs num_gpus >= 1 "
                         "per worker, and GPUs in the cluster)")
    others = [str(g) for g in range(max(node_gpus, 0)) if str(g) not in own]
    at = min(local_rank, len(others))
    order = others[:at] + list(own) + others[at:]
    return ",".join(order), at


class BaseWorker:
    """One rank. ``executable`` is the object made by ``start(executable_cls=…)`` (else None)."""

    executable: Any = None

    def __init__(self) -> None:
        self.rank = -1
        self._secret_fd: int | None = None

    # -- where am I ---------------------------------------------------------------------------
    def node_info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "gpu_ids": gpu_ids, "pid": os.getpid()}

    def use_own_gpus(self, local_rank: int) -> str:
        """Elastic with use_gpu: this node's GPUs, with the ones Ray gave this actor at ``local_rank``
        (CUDA_VISIBLE_DEVICES), and compute on it (PHALANX_DEVICE) when CUDA is there. Returns the list."""
        import ray
        import torch

        own = [str(g) for g in ray.get_gpu_ids()]
        node = ray.get_runtime_context().get_node_id()
        count = next((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["NodeID"] == node), len(own))
        visible, index = elastic_visible_devices(own, count, local_rank)
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        if torch.cuda.is_available():  # (a CPU build with Ray's logical GPUs, as in the tests: CPU)
            os.environ["PHALANX_DEVICE"] = f"cuda:{index}"
        return visible

    def nic_address(self, nics) -> tuple[str, str] | None:
        return _interface_address(list(nics))

    def free_port(self, addr: str) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return s.getsockname()[1]

    # -- set up -------------------------------------------------------------------------------
    def setup(self, env: dict[str, str], key: bytes | None, rank: int, threads: int,
              nice: int | None = None) -> int:
        """Take this rank's environment and the job secret; prefix output with the rank.

        ``nice``: the driver's niceness. Ray starts its workers at nice 15 (its ``worker_niceness``),
        where a ``phalanx run`` rank runs at its launcher's; the actor's thread (and the threads it
        starts later: gloo's, torch's) comes back to the driver's where the OS allows it (root, or
        CAP_SYS_NICE). Returns the niceness the rank runs at."""
        self.rank = rank
        niceness = _come_to_niceness(nice)
        os.environ.update({k: str(v) for k, v in env.items()})
        if key:
            os.environ[job_secret.SECRET_FILE_ENV] = self._keep_secret(key)
        import torch

        torch.set_num_threads(max(1, threads))
        from phalanx.elastic import inprocess

        elastic = inprocess.active()  # started by the elastic driver: the rank changes at each re-form
        if elastic:  # a re-form shuts the old group's connections down: never Ray's own
            inprocess.keep_current_connections()
            _record_exits(ElasticSettings.one("store"), ElasticSettings.one("worker_id"))
        if not isinstance(sys.stdout, _RankPrefixed):
            prefix = _elastic_prefix if elastic else f"[{rank}]: "
            sys.stdout = _RankPrefixed(sys.stdout, prefix, _WRITTEN)
            sys.stderr = _RankPrefixed(sys.stderr, prefix, _WRITTEN)
        return niceness

    def _keep_secret(self, key: bytes) -> str:
        """A 0600 file holding the secret, as the launcher's agent writes it.

        On Linux the file is unlinked at once and read through ``/proc/self/fd``: a killed
        actor (the failure path) leaves nothing on disk.
        """
        path = job_secret.write_secret_file(key)
        if not os.path.isdir("/proc/self/fd"):
            return path
        self._secret_fd = os.open(path, os.O_RDONLY)
        os.unlink(path)
        return f"/proc/self/fd/{self._secret_fd}"

    def lines_written(self) -> tuple[int, int]:
        """(this process's pid, the lines its rank has printed so far): what the driver waits to see."""
        return os.getpid(), _WRITTEN.lines

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        """Set environment variables in this actor (horovod.ray's method of the same name)."""
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def set_queue(self, queue) -> None:
        ray_logger.configure(queue)

    def start_executable(self, executable_cls=None, executable_args=None, executable_kwargs=None) -> None:
        if executable_cls is not None:
            self.executable = self._guard(lambda: executable_cls(*(executable_args or []),
                                                               **(executable_kwargs or {})))

    # -- work ---------------------------------------------------------------------------------
    def execute(self, fn):
        """``fn(self.executable)``; an exception comes back as :class:`WorkerFailure` with this rank."""
        return self._guard(lambda: fn(self.executable))

    def _guard(self, call):
        try:
            return call()
        except BaseException as exc:  # noqa: BLE001 - report everything, with the rank
            tb = exc.__traceback__
            while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == _HERE:
                tb = tb.tb_next  # the executor's own frames say nothing about the user's error
            text = "".join(traceback.format_exception(type(exc), exc, tb))
            try:
                import pickle

                pickle.dumps(exc)
                kept = exc
            except Exception:  # noqa: BLE001 - the exception itself would not pickle
                kept = None
            raise WorkerFailure(self.rank, text, kept, time.time()) from None
        finally:  # the actor may be killed next: what the function printed must reach Ray's log file first
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()

    def teardown(self) -> None:
        """Leave the phalanx job (if the function joined one) and forget the secret."""
        import phalanx.runtime as rt

        rt.shutdown()
        if self._secret_fd is not None:
            os.close(self._secret_fd)
            self._secret_fd = None

    def __repr__(self) -> str:
        return "PhalanxWorker"


_nice_warned = False


def warn_if_ranks_niced(got: list[int], nice: int) -> None:
    """Once per driver: the ranks run at a higher niceness than the driver (Ray's worker_niceness)."""
    global _nice_warned
    if _nice_warned or max(got) <= nice:
        return
    _nice_warned = True
    log.warning("phalanx on Ray: the ranks run at nice %d, the driver at %d (Ray's worker_niceness; only root or "
                "CAP_SYS_NICE may lower it): on a busy machine they get less CPU than `phalanx run` ranks. "
                "Start Ray with RAY_worker_niceness=0 in its environment (`RAY_worker_niceness=0 ray start --head`, "
                "or os.environ['RAY_worker_niceness'] = '0' before ray.init())", max(got), nice)
