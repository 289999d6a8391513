"""Runtime: who this process is, who its peers are, and the groups that join them.

``init()`` reads the job's settings once (:mod:`phalanx.settings`), reads the environment of
whatever started the process (:mod:`phalanx.runtime.env`), brings up PyTorch's default process
group (gloo on CPU, NCCL on CUDA) over the job's store (:mod:`phalanx.runtime.store`) and
returns an immutable :class:`~phalanx.runtime.topology.Topology`. Strategies take that object
as an argument; when given none they call :func:`topology` once, at construction.

Launchers understood: ``phalanx run``, torchrun, SLURM, Open MPI, MPICH/Intel MPI (PMI), and
plain ``python x.py`` (a world of one; collectives return at once).

Example::

    import phalanx as px
    topo = px.init()              # gloo+CPU here, NCCL+cuda:local_rank on GPUs
    print(topo.rank, topo.size, topo.local_rank, topo.cross_rank, topo.timeout_s)
    px.shutdown()
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

from phalanx.log import get_logger, set_level, set_rank
from phalanx.runtime.backends import engine
from phalanx.runtime.env import LaunchInfo, PhalanxRuntimeError, detect_environment, expand_nodelist
from phalanx.runtime.store import bound_tcp_store, forget_stores, rendezvous_store
from phalanx.runtime.topology import Topology, gather_hosts
from phalanx.settings import DEFAULT_TIMEOUT_S, Settings, SettingsError, load
from phalanx.settings import current as settings_now

__all__ = [
    "LaunchInfo",
    "PhalanxRuntimeError",
    "Topology",
    "detect_environment",
    "expand_nodelist",
    "bound_tcp_store",
    "import_dynamo_first",
    "exit_after_hooks",
    "skip_teardown_if_uncaught",
    "init",
    "shutdown",
    "is_initialized",
    "topology",
    "current_settings",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "DEFAULT_TIMEOUT_S",
]

_log = get_logger(__name__)
_lock = threading.Lock()
_exit_code_after_hooks: int | None = None


def exit_after_hooks(code: int | None) -> None:
    """At interpreter exit, end the process with ``code`` right after the exit hooks (atexit), without
    the interpreter's teardown.

    For a process whose ending is decided (a preemption checkpoint is complete on every rank): the
    teardown destroys c10d objects in arbitrary order, and with the threads of earlier groups (an
    elastic worker that re-formed) it sometimes aborted ("terminate called without an active
    exception", SIGABRT), so the launcher saw a crash instead of the decided status. Every exit hook
    (the runtime's shutdown, the heartbeat's last beat, an async checkpoint writer) still runs first.
    ``None`` cancels it.
    """
    global _exit_code_after_hooks
    _exit_code_after_hooks = code


_teardown_hook_installed = False


def skip_teardown_if_uncaught() -> None:
    """If an exception ends this process uncaught, end it with status 1 right after the traceback
    and the exit hooks, without the interpreter's teardown (see :func:`exit_after_hooks`): for an
    elastic worker whose script failed after a re-form, whose teardown sometimes aborted, so the
    launcher named a SIGABRT instead of the exception. An exception the script catches changes nothing."""
    global _teardown_hook_installed
    if _teardown_hook_installed:
        return
    _teardown_hook_installed = True
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        exit_after_hooks(1)

    sys.excepthook = hook


def _end_after_hooks() -> None:
    if _exit_code_after_hooks is not None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
                pass
        os._exit(_exit_code_after_hooks)


atexit.register(_end_after_hooks)  # at import, before every other phalanx hook: so it runs after them all
_topology: Topology | None = None
_settings: Settings | None = None
_owns_default_group = False


def _choose_backend_and_device(info: LaunchInfo, s: Settings) -> tuple[str, torch.device]:
    device = s.runtime.device
    if device is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    backend = s.runtime.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise SettingsError(f"backend 'nccl' (PHALANX_BACKEND or init(backend=)) needs a CUDA device but the "
                            f"device is {device}; accepted on CPU: gloo")
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if info.local_size > gpus:
            # NCCL refuses two ranks on one GPU, and says so only at the first collective.
            raise SettingsError(
                f"{info.local_size} ranks on this host share {gpus} GPU(s) but NCCL needs a GPU per rank; "
                f"start at most {gpus} rank(s) per host (phalanx run -np {gpus}), or share the GPU over "
                f"gloo with PHALANX_BACKEND=gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return backend, device


def init(
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> Topology:
    """Join the job and return its :class:`Topology`. Calling it again returns the same one.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is present, else gloo
            (env PHALANX_BACKEND).
        device: the device this rank computes on; default ``cuda:local_rank`` or CPU
            (env PHALANX_DEVICE).
        timeout: seconds a collective may wait for its peers before it raises
            (default 300, env PHALANX_TIMEOUT); kept as ``Topology.timeout_s``.

    Every setting is checked first (:func:`phalanx.settings.load`): a bad value raises
    :class:`~phalanx.settings.SettingsError`, one line naming it and the accepted values.
    """
    global _topology, _settings, _owns_default_group
    with _lock:
        if _topology is not None:
            return _topology
        s = load(backend=backend, device=device, timeout=timeout)
        set_level(s.runtime.log_level)
        _register_exit_shutdown()
        info = detect_environment()
        backend, device = _choose_backend_and_device(info, s)
        td = datetime.timedelta(seconds=s.runtime.timeout_s)
        if dist.is_initialized():
            # Someone (the user, a test framework) already made the default group: adopt it.
            _owns_default_group = False
            backend = engine()  # the engine under a c10d name registered over it (runtime.backends)
            info = dataclasses.replace(info, rank=dist.get_rank(), size=dist.get_world_size())
        else:
            _owns_default_group = True
            kwargs = {"backend": backend, "timeout": td}
            if device.type == "cuda":
                kwargs["device_id"] = device
            store = dist.HashStore() if info.size == 1 else rendezvous_store(info, td)
            import_dynamo_first()
            dist.init_process_group(store=store, rank=info.rank, world_size=info.size, **kwargs)
        hosts = gather_hosts(info, device)
        _topology = Topology(
            rank=info.rank,
            size=info.size,
            local_rank=info.local_rank,
            local_size=len(hosts[info.cross_rank]) if info.cross_rank < len(hosts) else info.local_size,
            cross_rank=info.cross_rank,
            cross_size=len(hosts),
            backend=backend,
            device=device,
            hosts=hosts,
            timeout_s=s.runtime.timeout_s,
        )
        _settings = s
        set_rank(info.rank)
        level = 20 if info.rank == 0 else 10  # INFO on rank 0, every rank's own line at DEBUG
        _log.log(level, "init: %s (launcher %s, store %s:%s)", _topology.describe(), info.source,
                 info.master_addr, info.master_port)
        return _topology


_exit_hook_registered = False


def _register_exit_shutdown() -> None:
    """Leave the job at interpreter exit if the script did not call :func:`shutdown`.

    Without it a process that exits right after a collective can tear down the
    process group's threads mid-flight and abort ("terminate called without an
    active exception"). Registered at the first ``init()``, so exit hooks added
    later (timeline, async checkpoint writer) run before it, while the group lives.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_shutdown_at_exit)


def import_dynamo_first() -> None:
    """Import ``torch._dynamo`` before a process group is made.

    torch.optim imports it at the first ``step()``. Imported while a gloo group exists
    (torch 2.13), it leaves that group referenced from C++, so ``destroy_process_group()``
    no longer stops gloo's threads ('pt_gloo_runloop', 'gloo_tcp_loop') and the store's;
    they are then torn down at process exit, which sometimes aborted a process whose script
    had finished ("terminate called without an active exception"; 3 of 12 two-rank runs
    under CPU load). One process reproduces it: init gloo, import torch._dynamo, destroy:
    the threads remain; importing it before the init: they are gone. The import costs
    nothing extra for a training script, which pays it at its first optimizer step anyway.

    TensorFlow first: dynamo imports triton when it is installed (every CUDA build of torch has
    it), and triton's LLVM loaded after TensorFlow's aborts the process ("LLVM ERROR:
    inconsistency in registered CommandLine options"). In a process that already holds
    TensorFlow, torch is told there is no triton: nothing of phalanx's TensorFlow and Keras
    fronts uses it (a compiled codec kernel runs eagerly instead, after one warning).
    """
    if "tensorflow" in sys.modules and "triton" not in sys.modules:
        sys.modules["triton"] = None  # `import triton` raises ImportError: torch's "no triton"
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - a torch build without dynamo: nothing to order
        pass


def _shutdown_at_exit() -> None:
    try:
        shutdown()
        # Exiting: also tear down groups phalanx adopted rather than made (elastic restarts,
        # a user's own init), and the stores, while the interpreter is whole. Left to static
        # destruction, gloo's device threads can be destroyed still joinable, which aborts
        # the process ("terminate called without an active exception") after a good run.
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_stores()
    except Exception:  # noqa: BLE001 - exiting anyway; a failing teardown must not mask the exit status
        pass


def shutdown() -> None:
    """Leave the job. ``init()`` may be called again afterwards."""
    global _topology, _owns_default_group
    with _lock:
        if _topology is not None and _owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        _topology = None
        _owns_default_group = False


def is_initialized() -> bool:
    return _topology is not None


def topology() -> Topology:
    """The topology from ``init()``; raises if ``init()`` has not been called."""
    if _topology is None:
        raise PhalanxRuntimeError("phalanx is not initialised: call phalanx.init() first")
    return _topology


def current_settings() -> Settings:
    """The settings ``init()`` read; before ``init()``, the environment's (:func:`phalanx.settings.current`)."""
    return _settings if _settings is not None else settings_now()


def rank() -> int:
    return topology().rank


def size() -> int:
    return topology().size


def local_rank() -> int:
    return topology().local_rank


def local_size() -> int:
    return topology().local_size


def cross_rank() -> int:
    return topology().cross_rank


def cross_size() -> int:
    return topology().cross_size
