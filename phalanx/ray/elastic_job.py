"""Elastic jobs on Ray: ``RayExecutor(settings, min_workers=, max_workers=)`` and ``ElasticRayExecutor``.

The driver plays the part ``phalanx run --min-np/--max-np`` plays: it runs the launcher's own
:class:`~phalanx.launcher.supervisor.Supervisor` (store, generations, replacements, admission,
``reset_limit``, ``elastic_timeout``), with a Ray actor in place of each worker process::

    run(fn): store on the driver's node ─ gen 0 = w0..w{n-1}, one actor each (num_cpus=cpus_per_worker)
    ray.kill(w1) / its process dies ─ the driver sees the actor die ─ publish gen 1 = survivors
        ─ they re-form in-process (phalanx.elastic.inprocess), roll back to the last commit in memory
    the cluster has a free slot (Ray's available CPUs), up to max_workers ─ a new actor joins
        ─ admitted at the members' next commit, gets the state from rank 0 in sync()
    fewer than min_workers for elastic_timeout ─ the job stops; run() raises naming the cause
    every member returned ─ run() returns their results in rank order; no actor is left

Slots come from the cluster: the job's running actors, plus the free resources (CPUs, and GPUs
with ``use_gpu``; or its own actors still waiting to be placed), capped at ``max_workers`` — or,
with ``override_discovery=False``, from ``settings.discovery`` (e.g. :mod:`phalanx.horovod.ray.elastic`'s TestDiscovery).
Every actor counts as one host ("ray"): ``local_rank`` is the rank.

GPUs (``use_gpu``): each actor asks Ray for ``gpus_per_worker`` GPUs (``num_gpus``); before the
function runs it sees its node's GPUs with its own at index ``local_rank``
(CUDA_VISIBLE_DEVICES, :func:`~phalanx.ray.worker.elastic_visible_devices`), so Horovod's
``torch.cuda.set_device(hvd.local_rank())`` lands on the GPU Ray gave it, and phalanx computes there
(PHALANX_DEVICE). A re-form changes ranks, not devices: the actor keeps its GPU.

Example::

    executor = RayExecutor(settings, min_workers=1, max_workers=2)
    executor.start()
    results = executor.run(train)          # train uses phalanx.elastic.run and a State
    executor.world_sizes                   # [(t0, 2), (t1, 1), (t2, 2)]: each generation, when published
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from phalanx.elastic import inprocess
from phalanx.launcher import secret as job_secret
from phalanx.launcher.supervisor import Supervisor
from phalanx.log import get_logger
from phalanx.ray.output import Arrivals, await_lines
from phalanx.ray.worker import (
    EXIT_KEY,
    BaseWorker,
    FunctionCall,
    WorkerFailure,
    warn_if_ranks_niced,
)

__all__ = ["ActorProcess", "ElasticJob", "HOST", "UNBOUNDED"]

log = get_logger(__name__)
HOST = "ray"  # the one host every actor counts as
UNBOUNDED = 1 << 20  # max_workers=None: as many as the cluster holds
_SENT = ("PHALANX_", "TORCHELASTIC_", "MASTER_", "HOROVOD_", "GLOO_", "NCCL_", "OMP_")
_PER_RANK = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")


class ActorProcess:
    """One elastic worker's actor behind the interface the supervisor uses for a process
    (``poll``, ``wait``, ``kill``, ``send_signal``, ``pid``, ``returncode``, empty output streams:
    Ray forwards the actor's output to the driver itself)."""

    def __init__(self, actor, name: str, wid: str, info_ref, done_ref, store) -> None:
        self.actor, self.name, self.wid, self.store = actor, name, wid, store
        self.stdin = None
        self.stdout, self.stderr = io.StringIO(), io.StringIO()
        self.returncode: int | None = None
        self.result: Any = None
        self.returned = False  # the function returned (not: the process ended with status 0)
        self.failure: str | None = None  # the traceback, when the function raised
        self._info_ref, self._done_ref, self._info = info_ref, done_ref, None
        self.created = time.monotonic()

    def placed(self) -> bool:
        """True once Ray has started the actor (it had a free slot)."""
        if self._info is None and ray.wait([self._info_ref], timeout=0)[0]:
            try:
                self._info = ray.get(self._info_ref)
            except Exception:  # noqa: BLE001 - it died before answering
                self._info = {}
        return self._info is not None

    @property
    def pid(self) -> int | str:
        return self._info.get("pid", "?") if self.placed() else "not placed"

    def poll(self) -> int | None:
        if self.returncode is not None or not ray.wait([self._done_ref], timeout=0)[0]:
            return self.returncode
        try:
            self.result, code = ray.get(self._done_ref), 0
            self.returned = True
        except RayTaskError as err:  # the function raised: this worker is lost (its group broken)
            cause = err.cause if isinstance(getattr(err, "cause", None), WorkerFailure) else None
            self.failure = cause.text if cause else str(err)
            print(f"[{self.wid}]: {self.failure}", file=sys.stderr, end="" if self.failure.endswith("\n") else "\n",
                  flush=True)
            code = 1
            self.kill()
        except RayActorError as err:  # killed, or ended its process (os._exit records the status first)
            log.info("actor %s (%s) ended: %s", self.name, self.wid, str(err).splitlines()[0][:300])
            key = EXIT_KEY + self.wid
            code = int(self.store.get(key)) if self.store.check([key]) else -9
        self.returncode = code
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            ray.wait([self._done_ref], timeout=0.05)
        return self.returncode

    def kill(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def send_signal(self, _signum) -> None:
        """Ray cannot signal an actor busy in its task: stopping it is killing it."""
        self.kill()


class ElasticJob:
    """One ``run(fn)`` of an elastic executor: the supervisor, its actors, the world size over time."""

    def __init__(self, executor, fn, args, kwargs, callbacks) -> None:
        self.executor, self.call = executor, FunctionCall(fn, args, kwargs)
        self.callbacks = list(callbacks or [])
        self.job = uuid.uuid4().hex[:8]
        self.handles: list[ActorProcess] = []
        self._nice = os.getpriority(os.PRIO_PROCESS, 0)  # the ranks come to the driver's niceness where allowed
        self._niceness: list = []  # each actor's setup: the niceness it runs at, not yet read
        self._niceness_lock = threading.Lock()
        self.world_sizes: list[tuple[float, int]] = []
        self.key = job_secret.new_secret()
        self.queue = None
        self._done = threading.Event()
        self._first: int | None = None  # the first generation's size, until the supervisor asked for it
        self.abort: str | None = None  # why the driver stopped the job itself
        self._short_since: float | None = None

    # -- what the supervisor calls ---------------------------------------------------------
    def slots(self) -> dict[str, int]:
        """Host discovery: the actors running, plus free CPUs (or our actors waiting for them)."""
        ex = self.executor
        if self._first is not None:  # the first generation: the size asked for (extra actors wait for room)
            first, self._first = self._first, None
            return {HOST: first}
        if ex.discovery() is not None:  # the discovery's slots include the job's own actors
            return {HOST: min(ex.max_workers or UNBOUNDED, ex.discovered_slots())}
        live = [h for h in self.handles if h.returncode is None]
        placed = sum(1 for h in live if h.placed())
        return {HOST: min(ex.max_workers or UNBOUNDED, placed + max(len(live) - placed, ex.free_slots()))}

    def start_worker(self, wid: str, host: str, env: dict[str, str]) -> ActorProcess:
        """The supervisor's starter: one actor, set up and running the function, without waiting."""
        ex = self.executor
        sent = {k: v for k, v in env.items() if k.startswith(_SENT) or k in _PER_RANK or k in ex.extra_env}
        sent["PHALANX_LAUNCHER"] = "ray"
        name = f"phalanx-{self.job}-{wid}"
        gpus = ex.spec.gpus_per_worker if ex.spec.use_gpu else 0
        actor = ray.remote(BaseWorker).options(num_cpus=ex.spec.cpus_per_worker, num_gpus=gpus, name=name,
                                               max_restarts=0, max_concurrency=1).remote()
        info = actor.node_info.remote()
        setup = actor.setup.remote(sent, self.key, int(env.get("RANK", -1)), max(1, int(ex.spec.cpus_per_worker)),
                                   self._nice)
        if ex.spec.use_gpu:  # before the function: CUDA reads CUDA_VISIBLE_DEVICES once, at its first use
            actor.use_own_gpus.remote(int(env.get("LOCAL_RANK", 0)))
        with self._niceness_lock:
            self._niceness.append(setup)
        if self.queue is not None:
            actor.set_queue.remote(self.queue)
        handle = ActorProcess(actor, name, wid, info, actor.execute.remote(self.call), self.supervisor.store)
        self.handles.append(handle)
        ex.worker_names.append(name)
        return handle

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> list[Any]:
        ex = self.executor
        if self.callbacks:
            from ray.util.queue import Queue

            self.queue = Queue(actor_options={"num_cpus": 0})
        env = dict(ex.extra_env)
        # survivors wait to re-form as long as the driver may wait for room (it stops the job itself)
        env.setdefault("PHALANX_ELASTIC_REFORM_TIMEOUT", str(ex.settings.timeout_s + ex.elastic_timeout + 30))
        self._first = ex.initial_workers()
        self.supervisor = sup = Supervisor(
            [], np=self._first, min_np=ex.min_workers, max_np=ex.max_workers or UNBOUNDED, env=env,
            script=self.slots, interval_s=1.0, max_restarts=ex.max_replacements, start_timeout=int(ex.settings.timeout_s),
            run_id=self.job, reset_limit=ex.reset_limit, cooldown=ex.cooldown_range,
            elastic_timeout=ex.elastic_timeout, starter=self.start_worker, store_addr=ray.util.get_node_ip_address())
        watcher = threading.Thread(target=self._watch, name="phalanx-ray-elastic", daemon=True)
        arrivals = Arrivals().open()
        watcher.start()
        try:
            code = sup.run()
        finally:
            self._done.set()
            watcher.join(5)
            self._record_sizes()
            self._drain()
            # what the finished ranks printed reaches the driver before their actors go (and the caller exits)
            await_lines(arrivals, [h.actor for h in self.handles if h.returned])
            arrivals.close()
            self._stop_all()
        if code == 130:
            raise KeyboardInterrupt("RayExecutor (elastic): interrupted; every actor of the job was stopped")
        if code != 0:
            raise RuntimeError(self._failure_text(code))
        # a member admitted in a generation that never formed (the others had finished) ended with
        # status 0 without a result: only the workers whose function returned
        return [w.proc.result for w in sup.members if w.proc.returned]

    def _watch(self) -> None:
        """Record each generation's size when published; hand rank 0's logs to the callbacks."""
        while not self._done.wait(0.02):
            self._record_sizes()
            self._drain()
            self._check_room()
            self._check_niceness()

    def _record_sizes(self) -> None:
        # from the supervisor's memory, not its store: a TCPStore client's get holds the client while
        # it waits for the key, so the supervisor's own set of that key (right after it counts the
        # generation) queued behind it: both stalled until the store's timeout, then this thread died
        published = self.supervisor.sizes
        self.world_sizes.extend(published[len(self.world_sizes):])

    def _check_niceness(self) -> None:
        """Warn once, as RayExecutor does, when an actor set up at a niceness above the driver's."""
        with self._niceness_lock:
            if not self._niceness:
                return
            ready, self._niceness = ray.wait(self._niceness, num_returns=len(self._niceness), timeout=0)
        for ref in ready:
            try:
                warn_if_ranks_niced([ray.get(ref)], self._nice)
            except Exception:  # noqa: BLE001 - an actor that died in setup: the supervisor reports it
                pass

    def _check_room(self) -> None:
        """Fewer than min_workers actors running for elastic_timeout, none of the others still
        starting (an actor Ray has not started within settings.timeout_s waits for room): stop the
        job. (The supervisor counts such an actor as starting, and would wait for it without bound.)"""
        ex = self.executor
        live = [h for h in list(self.handles) if h.returncode is None]
        running = sum(1 for h in live if h.placed())
        starting = any(not h.placed() and time.monotonic() - h.created < ex.settings.timeout_s for h in live)
        if running >= ex.min_workers or starting or self.abort:
            self._short_since = None
            return
        self._short_since = self._short_since or time.monotonic()
        if time.monotonic() - self._short_since > ex.elastic_timeout:
            self.abort = (f"{running} worker(s) running, fewer than min_workers {ex.min_workers} for elastic_timeout "
                          f"{ex.elastic_timeout:g}s: the cluster has no room for more (available: "
                          f"{ray.available_resources()}, each worker needs {ex.spec.worker_resources()}); "
                          "stopping the job")
            print(f"phalanx: {self.abort}", file=sys.stderr, flush=True)
            for h in list(self.handles):
                h.kill()

    def _drain(self) -> None:
        if self.queue is None:
            return
        n = self.queue.qsize()
        for item in self.queue.get_nowait_batch(n) if n else ():
            for cb in self.callbacks:
                cb(item)

    def _stop_all(self) -> None:
        for h in self.handles:
            h.kill()
        if self.queue is not None:
            try:
                ray.kill(self.queue.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        for h in self.handles:  # read (and drop) the killed tasks' results, or Ray logs them as unhandled
            if h.returncode is None:
                try:
                    ray.get(h._done_ref, timeout=5)
                except Exception:  # noqa: BLE001 - expected: killed
                    pass

    def _failure_text(self, code: int) -> str:
        store = self.supervisor.store
        stop = json.loads(store.get("pxe/stop")) if store.check(["pxe/stop"]) else {}
        why = self.abort or stop.get("abort") or (f"a worker could not re-form in-process (status {code}); on Ray there is no "
                                    "group restart to fall back to" if code == inprocess.REFORM_FAILED_EXIT
                                    else f"the job ended with status {code}")
        if self.abort and self.supervisor.first_failure:
            why += f" (first failure: {self.supervisor.first_failure})"
        for flag, arg in (("--min-np", "min_workers"), ("--elastic-timeout", "elastic_timeout"),
                          ("--reset-limit", "reset_limit")):
            why = why.replace(flag, arg)
        failed = [h for h in self.handles if h.failure]
        tail = f"\nfirst worker traceback ({failed[0].wid}):\n{failed[0].failure}" if failed else ""
        return f"RayExecutor (elastic): {why}{tail}"


