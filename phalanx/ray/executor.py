"""``RayExecutor``: a phalanx job on Ray actors, with horovod.ray's API.

Code written for ``horovod.ray`` runs with only the import changed::

    import ray
    import phalanx.horovod as hvd                  # was: import horovod.torch as hvd
    from phalanx.ray import RayExecutor            # was: from horovod.ray import RayExecutor

    ray.init()
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=1)
    executor.start()

    def simple_fn():
        hvd.init()
        return hvd.rank()

    assert executor.run(simple_fn) == [0, 1]      # one result per worker, in rank order
    executor.shutdown()

How a job comes up (``start``): one placement group, one actor per rank
(:mod:`phalanx.ray.placement`); ranks host-major from where the actors landed; rank 0's
node address (on the first of ``settings.nics`` it has, when given) and a free port on it
become MASTER_ADDR/MASTER_PORT; each actor gets the variables ``phalanx run`` sets and the
job secret (a fresh one per job, sent over Ray to the actor, kept in a 0600 file named by
PHALANX_SECRET_FILE, never in the environment or on a command line); its output is
prefixed ``[rank]: `` on the driver. The function itself calls ``px.init()`` /
``hvd.init()``, as under ``phalanx run``.

When a rank raises, the driver raises :class:`phalanx.RankError` naming that rank with its
traceback, after killing every actor of the job (the others would wait in a collective).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from phalanx.launcher import secret as job_secret
from phalanx.launcher.spawn import RankError
from phalanx.log import get_logger
from phalanx.ray.elastic_job import ElasticJob
from phalanx.ray.output import Arrivals, await_lines
from phalanx.ray.placement import (
    STRATEGIES,
    WorkerSpec,
    place_workers,
    rank_environments,
    ranks_host_major,
)
from phalanx.ray.worker import FunctionCall, WorkerFailure, warn_if_ranks_niced

__all__ = ["RayExecutor", "Settings", "start_lean_ray"]

log = get_logger(__name__)
_GRACE_S = 0.5  # after the first failure, how long other ranks' failures are still collected


@dataclasses.dataclass
class Settings:
    """What ``RayExecutor.create_settings`` returns (horovod.ray's MiniSettings).

    ``timeout_s`` bounds the start-up (actors up and answering); collectives use
    PHALANX_TIMEOUT (pass it in ``start(extra_env_vars=…)``). ``nics``: interfaces the
    ranks talk on (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, and rank 0's address on it).
    """

    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    nics: set | None = None
    verbose: int = 1
    ssh_identity_file: str | None = None
    elastic: bool = False
    # ElasticRayExecutor.create_settings (horovod.ray's elastic settings)
    min_np: int | None = None
    max_np: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    # elastic: where the slots come from instead of Ray's free resources (with override_discovery=False),
    # e.g. phalanx.horovod.ray.elastic.TestDiscovery; anything with find_available_hosts_and_slots()
    discovery: Any = None


_dedup_warned = False


def _warn_if_dedup_hides_ranks() -> None:
    global _dedup_warned
    if _dedup_warned or os.environ.get("RAY_DEDUP_LOGS", "1") == "0" or os.environ.get("RAY_DEDUP_LOGS_ALLOW_REGEX"):
        return
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        return  # inside an actor (a Tune trial): the folding happens in the job's driver, not here
    _dedup_warned = True
    log.warning("Ray folds log lines that differ only in numbers, so most ranks' output will show as "
                "'[repeated Nx across cluster]'; set RAY_DEDUP_LOGS=0 (or import phalanx.ray before ray)")


def start_lean_ray() -> None:
    """``ray.init()`` for a job that starts its own local cluster: no dashboard, and workers at
    the driver's niceness (Ray's default puts them at nice 15, below its daemons and anything
    else on the machine, where ``phalanx run``'s ranks run at their launcher's niceness).

    A cluster you start yourself: ``ray.init(include_dashboard=False)`` with
    ``RAY_worker_niceness=0`` in the environment (or ``RAY_worker_niceness=0 ray start --head
    --include-dashboard=false``); see docs/ray.md. With ``RAY_ADDRESS`` set this connects to
    that cluster, which keeps its own settings."""
    added = "RAY_worker_niceness" not in os.environ
    if added:  # read by the raylet and the workers it starts, which inherit it from this process
        os.environ["RAY_worker_niceness"] = "0"
    try:
        ray.init(include_dashboard=False)
    finally:
        if added:
            del os.environ["RAY_worker_niceness"]


class RayExecutor:
    """Run a phalanx job on Ray actors; see the module docstring."""

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: str | None = None, ssh_str: str | None = None,
                        placement_group_timeout_s: float = 100, nics=None, verbose: int = 1) -> Settings:
        """Settings for the executor. ``ssh_*`` are accepted for horovod.ray compatibility and unused
        (Ray starts the processes; nothing is reached over SSH)."""
        if timeout_s <= 0:
            raise ValueError(f"create_settings: timeout_s must be positive seconds, got {timeout_s}")
        return Settings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s,
                        nics=set(nics) if nics else None, verbose=verbose, ssh_identity_file=ssh_identity_file)

    def __init__(self, settings: Settings | None = None, num_workers: int | None = None, num_hosts: int | None = None,
                 num_workers_per_host: int = 1, cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None, use_current_placement_group: bool = True,
                 placement_strategy: str = "PACK", min_workers: int | None = None, max_workers: int | None = None,
                 reset_limit: int | None = None, cooldown_range=None, elastic_timeout: int = 600,
                 override_discovery: bool = True) -> None:
        settings = settings or Settings()
        self.elastic = min_workers is not None or max_workers is not None
        if self.elastic:
            num_workers = self._check_elastic(num_workers, num_hosts, use_gpu, min_workers, max_workers, reset_limit,
                                              cooldown_range, elastic_timeout)
        if num_workers is not None and num_hosts is not None:
            raise ValueError("RayExecutor: give num_workers or num_hosts (with num_workers_per_host), not both")
        if num_workers is None and num_hosts is None:
            raise ValueError("RayExecutor: give num_workers=N, or num_hosts=H with num_workers_per_host=K")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive integer, got {value!r}")
        if cpus_per_worker <= 0:
            raise ValueError(f"RayExecutor: cpus_per_worker must be positive, got {cpus_per_worker}")
        if gpus_per_worker and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker is set but use_gpu is False; pass use_gpu=True")
        if use_gpu and gpus_per_worker is not None and gpus_per_worker <= 0:
            raise ValueError(f"RayExecutor: gpus_per_worker must be positive, got {gpus_per_worker}")
        if placement_strategy not in STRATEGIES:
            raise ValueError(f"RayExecutor: placement_strategy must be one of {STRATEGIES}, got {placement_strategy!r}")
        self.settings = settings
        self.spec = WorkerSpec(num_workers, num_hosts, num_workers_per_host, cpus_per_worker, use_gpu,
                               float(gpus_per_worker or 1), placement_strategy, use_current_placement_group,
                               settings.placement_group_timeout_s)
        self.workers: list[Any] = []  # actors in rank order
        self.worker_names: list[str] = []
        self._group = None
        self._queue = None
        self._arrivals = Arrivals()  # the lines the driver has received from each rank
        self.startup_s: float | None = None
        self.world_sizes: list[tuple[float, int]] = []  # elastic: (time, size) of each generation, when published
        self.extra_env: dict[str, str] = {}
        self.override_discovery = override_discovery
        if self.elastic and not override_discovery and settings.discovery is not None \
                and not callable(getattr(settings.discovery, "find_available_hosts_and_slots", None)):
            raise ValueError(f"RayExecutor: settings.discovery ({settings.discovery!r}) has no "
                             "find_available_hosts_and_slots(); use phalanx.horovod.ray.elastic's RayHostDiscovery or TestDiscovery")

    def _check_elastic(self, num_workers, num_hosts, use_gpu, min_workers, max_workers, reset_limit, cooldown_range,
                       elastic_timeout) -> int:
        """Check the elastic arguments, keep them; the starting size (num_workers, else min_workers)."""
        if num_hosts is not None:
            raise ValueError("RayExecutor: num_hosts is for a fixed-size job; an elastic job (min_workers/max_workers) "
                             "places one actor per worker wherever Ray has room: drop num_hosts")
        min_workers = 1 if min_workers is None else min_workers
        for name, value in (("min_workers", min_workers), ("max_workers", max_workers)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive integer, got {value!r}")
        if max_workers is not None and min_workers > max_workers:
            raise ValueError(f"RayExecutor: min_workers={min_workers} is larger than max_workers={max_workers}; "
                             "give min_workers <= max_workers")
        if num_workers is not None and not (min_workers <= num_workers <= (max_workers or num_workers)):
            raise ValueError(f"RayExecutor: num_workers={num_workers} (the starting size of an elastic job) must lie "
                             f"between min_workers={min_workers} and max_workers={max_workers}")
        if elastic_timeout <= 0:
            raise ValueError(f"RayExecutor: elastic_timeout must be positive seconds, got {elastic_timeout}")
        if reset_limit is not None and reset_limit < 0:
            raise ValueError(f"RayExecutor: reset_limit must be >= 0 (or None: no limit), got {reset_limit}")
        if cooldown_range is not None and (len(cooldown_range) != 2 or not 0 <= cooldown_range[0] <= cooldown_range[1]):
            raise ValueError(f"RayExecutor: cooldown_range must be (low, high) seconds, got {cooldown_range!r}")
        self.min_workers, self.max_workers, self.reset_limit = min_workers, max_workers, reset_limit
        self.cooldown_range = tuple(cooldown_range) if cooldown_range else None
        self.elastic_timeout, self.requested_workers = float(elastic_timeout), num_workers
        self.max_replacements = 4 * (max_workers or max(min_workers, num_workers or 1)) + 4
        return num_workers or min_workers

    def initial_workers(self) -> int:
        """Elastic: how many workers the first generation has (num_workers, else what fits now, within bounds)."""
        if self.requested_workers is not None:
            return self.requested_workers
        free = self.free_slots() if self.discovery() is None else self.discovered_slots()
        return max(self.min_workers, min(self.max_workers or free, free))

    def free_slots(self) -> int:
        """How many more workers Ray has free resources for now (CPUs, and GPUs with use_gpu)."""
        free = ray.available_resources()
        return min(int(free.get(k, 0.0) / v + 1e-9) for k, v in self.spec.worker_resources().items())

    def discovery(self):
        """The discovery object that sizes an elastic job (settings.discovery with override_discovery=False), or None."""
        return None if self.override_discovery else self.settings.discovery

    def discovered_slots(self) -> int:
        """All the slots the discovery object reports (the job's own workers included)."""
        return sum(self.discovery().find_available_hosts_and_slots().values())

    @property
    def num_workers(self) -> int:
        return self.spec.world_size

    # -- start ----------------------------------------------------------------------------------
    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None, extra_env_vars: dict | None = None) -> None:
        """Start one actor per rank and give each its rank's environment; then, if given,
        ``executable_cls(*executable_args, **executable_kwargs)`` in every actor."""
        if self.workers:
            raise RuntimeError("RayExecutor.start: already started; call shutdown() first")
        began = time.perf_counter()
        if not ray.is_initialized():
            start_lean_ray()  # where Ray's own first remote call would ray.init() with every daemon
        _warn_if_dedup_hides_ranks()
        if self.elastic:
            if executable_cls is not None:
                raise ValueError("RayExecutor.start: executable_cls is for a fixed-size job (execute); an elastic "
                                 "job runs a function with run(fn), as horovod.ray's ElasticRayExecutor")
            self.extra_env = {k: str(v) for k, v in (extra_env_vars or {}).items()}
            self._wait_for_room()
            self.startup_s = time.perf_counter() - began
            return
        self._arrivals.open()
        placed = place_workers(self.spec, job=uuid.uuid4().hex[:8])
        self._group, self.worker_names = placed.group, placed.names
        self.workers = placed.workers
        try:
            infos = self._get([w.node_info.remote() for w in placed.workers], self.settings.timeout_s, "start the actors")
            order = ranks_host_major(infos)
            self.workers = [placed.workers[i] for i in order]
            self.worker_names = [placed.names[i] for i in order]
            infos = [infos[i] for i in order]
            envs = self._environments(infos, dict(extra_env_vars or {}))
            key = job_secret.new_secret()
            threads, nice = max(1, int(self.spec.cpus_per_worker)), os.getpriority(os.PRIO_PROCESS, 0)
            got = self._get([w.setup.remote(env, key, r, threads, nice)
                             for r, (w, env) in enumerate(zip(self.workers, envs))],
                            self.settings.timeout_s, "set up the actors")
            warn_if_ranks_niced(got, nice)
            if executable_cls is not None:
                self._gather([w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                              for w in self.workers])
        except BaseException:
            self.shutdown()
            raise
        self.startup_s = time.perf_counter() - began
        log.info("RayExecutor: %d workers up in %.2fs", len(self.workers), self.startup_s)

    def _wait_for_room(self) -> None:
        """Elastic: until the cluster has room (CPUs, and GPUs with use_gpu) for min_workers (bounded by
        placement_group_timeout_s)."""
        deadline = time.monotonic() + self.settings.placement_group_timeout_s
        while self.free_slots() < self.min_workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"RayExecutor: the cluster has no room for min_workers={self.min_workers} workers of "
                                   f"{self.spec.worker_resources()} within placement_group_timeout_s="
                                   f"{self.settings.placement_group_timeout_s:g}; available: {ray.available_resources()}"
                                   + ("; use_gpu needs GPUs in the cluster (ray.init(num_gpus=N) / ray start --num-gpus)"
                                      if self.spec.use_gpu else ""))
            time.sleep(0.2)

    def _environments(self, infos: list[dict], extra: dict) -> list[dict[str, str]]:
        addr, iface = infos[0]["ip"], None
        if self.settings.nics:
            found = ray.get(self.workers[0].nic_address.remote(sorted(self.settings.nics)))
            if found is None:
                raise ValueError(f"RayExecutor: none of the interfaces {sorted(self.settings.nics)} (settings.nics) "
                                 f"exists on rank 0's node {infos[0]['hostname']}; name one it has")
            iface, addr = found
        port = ray.get(self.workers[0].free_port.remote(addr))
        return rank_environments(infos, master_addr=addr, master_port=port, use_gpu=self.spec.use_gpu, iface=iface,
                                 nics=self.settings.nics, extra=extra)

    # -- work -----------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None,
            callbacks: list[Callable] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order. ``callbacks`` get each
        dict rank 0 sends with :func:`phalanx.ray.ray_logger.log`, as it arrives."""
        if self.elastic:
            return self._run_elastic(fn, args, kwargs, callbacks)
        self._check_started("run")
        self._set_queue(callbacks)
        return self._gather([w.execute.remote(FunctionCall(fn, args, kwargs)) for w in self.workers], callbacks)

    def _run_elastic(self, fn, args, kwargs, callbacks) -> list[Any]:
        """One elastic job: actors come and go; the results of the workers that finished, in rank order."""
        if self.startup_s is None:
            raise RuntimeError("RayExecutor.run: call start() first")
        job = ElasticJob(self, fn, args, kwargs, callbacks)
        self.world_sizes, self.worker_names = job.world_sizes, []
        return job.run()

    def run_remote(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None) -> list[Any]:
        """As :meth:`run` without waiting: one ObjectRef per rank (``ray.get`` them; a failure is then
        yours to handle: call :meth:`shutdown` so no rank is left waiting in a collective)."""
        self._check_started("run_remote")
        return [w.execute.remote(FunctionCall(fn, args, kwargs)) for w in self.workers]

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None) -> list[Any]:
        """``fn(executable)`` on every rank (the object made by ``start(executable_cls=…)``)."""
        self._check_started("execute")
        self._set_queue(callbacks)
        return self._gather([w.execute.remote(fn) for w in self.workers], callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._check_started("execute_single")
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    def shutdown(self) -> None:
        """Stop every actor of the job and release its placement group. Safe to call twice."""
        workers, self.workers = self.workers, []
        if workers:
            try:  # a clean goodbye where the actor is idle; a busy or dead one is simply killed
                ray.wait([w.teardown.remote() for w in workers], num_returns=len(workers), timeout=2)
            except Exception:  # noqa: BLE001 - killing follows anyway
                pass
        for actor in [*workers, *([self._queue.actor] if self._queue is not None else [])]:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        self._queue = None
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._group)
            except Exception:  # noqa: BLE001 - already removed
                pass
            self._group = None
        self._arrivals.close()

    # -- helpers --------------------------------------------------------------------------------
    def _check_started(self, what: str) -> None:
        if self.elastic:
            raise RuntimeError(f"RayExecutor.{what}: an elastic job (min_workers/max_workers) runs functions with "
                               "run(fn) only; its actors change as the job grows and shrinks")
        if not self.workers:
            raise RuntimeError(f"RayExecutor.{what}: no workers; call start() first (or the job was shut down "
                               "after a failure)")

    def _set_queue(self, callbacks) -> None:
        if callbacks and self._queue is None:
            from ray.util.queue import Queue

            self._queue = Queue(actor_options={"num_cpus": 0})
            ray.get([w.set_queue.remote(self._queue) for w in self.workers])

    def _drain(self, callbacks) -> None:
        if not callbacks or self._queue is None:
            return
        n = self._queue.qsize()
        for item in self._queue.get_nowait_batch(n) if n else ():
            for cb in callbacks:
                cb(item)

    def _get(self, refs, timeout: float, what: str):
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            missing = [i for i, r in enumerate(refs) if r not in ready]
            raise TimeoutError(f"RayExecutor: workers {missing} did not {what} within settings.timeout_s="
                               f"{self.settings.timeout_s:g}s") from None

    def _gather(self, refs: list, callbacks: list[Callable] | None = None) -> list[Any]:
        """Wait for every rank; on the first failure kill the job and raise RankError naming the rank."""
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending, results, failures = list(refs), {}, {}
        first_failure = None
        poll = 0.1 if callbacks else None
        while pending:
            if first_failure is not None:
                left = first_failure + _GRACE_S - time.monotonic()
                if left <= 0:
                    break
                ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            else:
                ready, pending = ray.wait(pending, num_returns=1, timeout=poll)
            self._drain(callbacks)
            for ref in ready:
                r = rank_of[ref]
                try:
                    results[r] = ray.get(ref)
                except RayTaskError as err:
                    cause = err.cause if isinstance(getattr(err, "cause", None), WorkerFailure) else None
                    failures[r] = cause or WorkerFailure(r, str(err), None, time.time())
                except RayActorError as err:
                    failures[r] = WorkerFailure(r, f"the actor died: {err}", None, 0.0)  # a death comes first
                if r in failures and first_failure is None:
                    first_failure = time.monotonic()
        self._drain(callbacks)
        if failures:
            self.shutdown()
            for ref in pending:  # the killed ranks' results: read (and drop) them, or Ray logs them as unhandled
                try:
                    ray.get(ref, timeout=5)
                except Exception:  # noqa: BLE001 - expected: the actor was killed
                    pass
            root = min(failures, key=lambda r: (failures[r].at, r))
            others = sorted(set(failures) - {root})
            extra = f" (ranks {others} failed too)" if others else ""
            stopped = sorted(rank_of[p] for p in pending)
            if stopped:
                extra += f"; ranks {stopped} were stopped"
            f = failures[root]
            raise RankError(f"rank {root} failed{extra}; every actor of the job was stopped:\n{f.text}", root,
                            f.exception)
        await_lines(self._arrivals, self.workers)  # what the ranks printed, before the caller's script can exit
        return [results[r] for r in range(len(refs))]

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
