"""Parameter-server worker role, and ``run_ps`` which gives every rank its role.

A worker holds a full replica of the model. ``pull()`` fetches every shard from
its server (it may be held back there: sync waits for the round, SSP for the
slowest worker); ``push()`` sends the gradient of each shard to its server.

    ranks:  [0 .. S-1] servers        [S .. N-1] workers
    worker loop:  pull() -> forward/backward -> push() -> ... -> close()

With ``prefetch=True`` (the default) a push also asks for the next pull, so a
steady-state step is one request per server instead of two; the server answers
as soon as the mode allows, and ``pull()`` only waits for that answer. Turn it
off when a worker does long work between ``push()`` and ``pull()`` in async mode
and wants the parameters as of the pull rather than as of the push.

Example::

    import phalanx as px, torch
    from phalanx.ps import run_ps

    def train(worker):                        # runs on every worker rank
        for x, y in my_batches(worker.index, worker.num_workers):
            worker.pull()
            worker.model.zero_grad()
            torch.nn.functional.cross_entropy(worker.model(x), y).backward()
            worker.push()
        worker.pull()                          # the final parameters
        return evaluate(worker.model)

    px.init()
    out = run_ps(make_model, lambda ps: torch.optim.SGD(ps, lr=0.1), train,
                 num_servers=1, mode="ssp", staleness=2)
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from phalanx.comm.compression.codecs import get_compressor
from phalanx.ps.protocol import MetaCache, Op, PSError, recv_frame, send_frame, wait_work
from phalanx.ps.server import MODES, ParameterServer, shard_parameters
from phalanx.runtime.jobkey import job_key
from phalanx.settings import LauncherSettings

__all__ = ["PSWorker", "WorkerStats", "run_ps", "roles"]


@dataclasses.dataclass
class WorkerStats:
    """Bytes and seconds one worker spent talking to the servers."""

    worker: int = 0
    steps: int = 0
    pull_bytes: int = 0
    push_bytes: int = 0
    pull_s: float = 0.0  # includes time held back by sync / SSP
    push_s: float = 0.0
    staleness: dict[int, int] = dataclasses.field(default_factory=dict)  # server version drift seen at pull

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class PSWorker:
    """The worker role: a model replica that pulls parameters and pushes gradients.

    Example::

        worker = PSWorker(model, servers=[0], workers=[1, 2])
        worker.pull(); loss.backward(); worker.push(); ...; worker.close()

    ``key``: HMAC key of the frames' metas, as :class:`~phalanx.ps.server.ParameterServer`'s
    (default: the job secret); both ends must hold the same one.
    """

    def __init__(self, model: nn.Module, *, servers, workers, compression=None, timeout_s: float = 300.0,
                 prefetch: bool = True, rank: int | None = None,
                 key: bytes | None = None) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank() if rank is None else rank
        self.servers, self.workers = list(servers), list(workers)
        if self.rank not in self.workers:
            raise ValueError(f"rank {self.rank} is not in workers={self.workers}")
        self.index, self.num_workers = self.workers.index(self.rank), len(self.workers)
        self.model = model
        named = dict(model.named_parameters())
        self.shards = [[named[n] for n in names]
                       for names in shard_parameters({n: p.numel() for n, p in named.items()}, len(self.servers))]
        self.compressor = get_compressor(compression)
        self.timeout_s = timeout_s
        self.prefetch = prefetch
        # frame metas signed with the job secret (phalanx run makes one), checked before decoding
        self.cache = MetaCache(key=key if key is not None else job_key())
        self.clock = 0
        self._versions = [0] * len(self.servers)
        self._asked = [0] * len(self.servers)  # pulls asked of each server whose answer is not read yet
        self._read = [0] * len(self.servers)  # PARAMS replies read from each server (acknowledged in every frame)
        self._push_works: list = []  # push sends in flight; their buffers live as long as they do
        self._closed = False
        self.stats = WorkerStats(worker=self.index)

    def _what(self, server: int, verb: str) -> str:
        return f"worker rank {self.rank} {verb} server rank {server}"

    def pull(self) -> None:
        """Copy the servers' current parameters into the model (may wait for sync / SSP)."""
        t0 = time.perf_counter()
        for i, s in enumerate(self.servers):  # ask every server first, so they work in parallel
            if not self._asked[i]:
                send_frame(s, Op.PULL, clock=self.clock, timeout_s=self.timeout_s, what=self._what(s, "asking"),
                           read=self._read[i])
                self._asked[i] = 1
        for i, (s, params) in enumerate(zip(self.servers, self.shards)):
            for _ in range(self._asked[i]):  # more than one if push() ran twice since the last pull()
                self._receive(i, s, params)
            self._asked[i] = 0
        for work, _buf, s in self._push_works:  # answered, so received: completes at once
            wait_work(work, self.timeout_s, self._what(s, "pushing to"))
        self._push_works.clear()
        self.stats.pull_s += time.perf_counter() - t0

    def _receive(self, i: int, s: int, params: list[nn.Parameter]) -> None:
        header, flat, nbytes = recv_frame(s, self.compressor, reply=True, timeout_s=self.timeout_s,
                                          cache=self.cache, what=self._what(s, "waiting for parameters from"))
        if header[0] != Op.PARAMS:
            raise PSError(f"{self._what(s, 'got op ' + str(header[0]) + ' from')}, expected PARAMS")
        self._read[i] += 1
        drift = max(header[2] - self._versions[i] - 1, 0)
        if self.clock:  # how many other updates landed since our last pull (async drift)
            self.stats.staleness[drift] = self.stats.staleness.get(drift, 0) + 1
        self._versions[i] = header[2]
        self.stats.pull_bytes += nbytes
        if flat is None:
            return
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def push(self, grads: list[torch.Tensor] | None = None) -> None:
        """Send gradients (default: each parameter's ``.grad``) to the servers; advances the clock."""
        t0 = time.perf_counter()
        named = list(self.model.parameters())
        if grads is not None:
            if len(grads) != len(named):
                raise ValueError(f"push(grads): got {len(grads)} tensors for {len(named)} parameters")
            by_param = {id(p): g for p, g in zip(named, grads)}
        else:
            missing = [i for i, p in enumerate(named) if p.grad is None]
            if missing:
                raise ValueError(f"push(): parameters {missing[:5]} have no .grad; call backward() first "
                                 "or pass grads=")
            by_param = {id(p): p.grad for p in named}
        for i, (s, params) in enumerate(zip(self.servers, self.shards)):
            flat = (torch.cat([by_param[id(p)].detach().reshape(-1) for p in params])
                    if params else None)
            works, nbytes = send_frame(s, Op.PUSH, clock=self.clock, version=self._versions[i], tensor=flat,
                                       arg=int(self.prefetch), compressor=self.compressor, cache=self.cache,
                                       timeout_s=self.timeout_s, wait=False, what=self._what(s, "pushing to"),
                                       read=self._read[i])
            self._push_works.extend((work, buf, s) for work, buf in works)
            self._asked[i] += int(self.prefetch)
            self.stats.push_bytes += nbytes
        self.clock += 1
        self.stats.steps += 1
        self.stats.push_s += time.perf_counter() - t0

    def close(self) -> None:
        """Read any prefetched answer (the model ends with the latest parameters), then tell
        the servers this worker is done (they stop waiting for it)."""
        if self._closed:
            return
        self._closed = True
        if any(self._asked) or self._push_works:
            self.pull()
        for i, s in enumerate(self.servers):
            send_frame(s, Op.DONE, clock=self.clock, timeout_s=self.timeout_s, what=self._what(s, "leaving"),
                       read=self._read[i])


def roles(world_size: int, num_servers: int) -> tuple[list[int], list[int]]:
    """``(servers, workers)``: the first ``num_servers`` ranks serve, the rest work."""
    if not 1 <= num_servers < world_size:
        raise ValueError(f"num_servers={num_servers} must be between 1 and world size - 1 = {world_size - 1} "
                         "(at least one rank must be a worker); e.g. phalanx run -np 3 --servers 1")
    return list(range(num_servers)), list(range(num_servers, world_size))


def run_ps(model_fn, optimizer_fn, train_fn, *, num_servers: int | None = None, mode: str = "sync",
           staleness: int = 0, staleness_lr: bool = False, compression=None, prefetch: bool = True,
           timeout: float | None = None, checkpoint=None) -> dict:
    """Run this rank's role (``phalanx.init()`` done). Returns ``{"role", "stats", "result"}``.

    ``model_fn()`` must build the same model on every rank (seed it); ``train_fn(worker)``
    runs on workers and its return value is ``result``. ``num_servers`` defaults to
    PHALANX_NUM_SERVERS (set by ``phalanx run --servers N``), else 1.

    ``checkpoint``: a ``phalanx.checkpoint.CheckpointManager`` (anything with
    ``load_latest(state)`` and ``save(step, state)``). The session starts from its
    newest intact checkpoint, if any, and every rank saves into it when the session
    ends: each server writes its shard (parameters, optimizer state, version), as one
    rank of a sharded checkpoint whose step is server 0's version. A session is the
    unit of checkpointing: to save every N steps, run ``run_ps`` once per N steps.

    Example::

        mgr = phalanx.checkpoint.CheckpointManager("ckpt", keep=2)
        for epoch in range(10):          # one session per epoch: resumes, trains, saves
            run_ps(make_model, make_opt, train_one_epoch, mode="ssp", staleness=2, checkpoint=mgr)
    """
    from phalanx.runtime import topology

    topo = topology()
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {MODES}")
    if checkpoint is not None and not (hasattr(checkpoint, "save") and hasattr(checkpoint, "load_latest")):
        raise TypeError(f"checkpoint= must be a phalanx.checkpoint.CheckpointManager, got {type(checkpoint).__name__}")
    if num_servers is None:
        num_servers = LauncherSettings.one("num_servers")
    servers, workers = roles(topo.size, num_servers)
    timeout_s = topo.timeout_s if timeout is None else float(timeout)
    model = model_fn()
    if topo.rank in servers:
        server = ParameterServer(model, optimizer_fn, servers=servers, workers=workers, mode=mode,
                                 staleness=staleness, staleness_lr=staleness_lr, compression=compression,
                                 timeout_s=timeout_s)
        state = {"ps_shard": server}
        # collective: workers take part with an empty state
        resumed = checkpoint.load_latest(state) if checkpoint is not None else None
        start = server.version
        stats = server.serve().as_dict()
        _end_session(checkpoint, state, resumed, (start, server.version))
        return {"role": "server", "stats": stats, "result": None}
    resumed = checkpoint.load_latest({}) if checkpoint is not None else None
    worker = PSWorker(model, servers=servers, workers=workers, compression=compression, timeout_s=timeout_s,
                      prefetch=prefetch)
    try:
        result = train_fn(worker)
    finally:
        worker.close()
    _end_session(checkpoint, {}, resumed, (0, 0))
    return {"role": "worker", "stats": worker.stats.as_dict(), "result": result}


def _end_session(checkpoint, state: dict, resumed: str | None, versions: tuple[int, int]) -> None:
    from phalanx.comm.collectives import barrier, broadcast_object

    if checkpoint is not None:  # rank 0 is always a server: its version names the step
        start, step = broadcast_object(versions, root_rank=0)
        if resumed is None or step != start:  # else nothing changed since the checkpoint we loaded
            checkpoint.save(step, state)  # a synchronous save ends with a barrier
    barrier()  # a later session's messages must not reach this session's server loop
