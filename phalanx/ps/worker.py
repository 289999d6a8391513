"""Parameter-server worker role, and ``run_ps`` which gives every rank its role.

A worker holds a full replica of the model. ``pull()`` fetches every shard from
its server (it may be held back there: sync waits for the round, SSP for the
slowest worker); ``push()`` sends the gradient of each shard to its server.

    ranks:  [0 .. S-1] servers        [S .. N-1] workers
    worker loop:  pull() -> forward/backward -> push() -> ... -> close()

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
import os
import time

import torch
from torch import nn

from phalanx.comm.compression import get_compressor
from phalanx.ps.protocol import Op, PSError, recv_frame, send_frame
from phalanx.ps.server import MODES, ParameterServer, shard_parameters

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
    """

    def __init__(self, model: nn.Module, *, servers, workers, compression=None, timeout_s: float = 300.0,
                 rank: int | None = None) -> None:
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
        self.clock = 0
        self._versions = [0] * len(self.servers)
        self._closed = False
        self.stats = WorkerStats(worker=self.index)

    def _what(self, server: int, verb: str) -> str:
        return f"worker rank {self.rank} {verb} server rank {server}"

    def pull(self) -> None:
        """Copy the servers' current parameters into the model (may wait for sync / SSP)."""
        t0 = time.perf_counter()
        for s in self.servers:  # ask every server first, so they work in parallel
            send_frame(s, Op.PULL, clock=self.clock, timeout_s=self.timeout_s, what=self._what(s, "asking"))
        for i, (s, params) in enumerate(zip(self.servers, self.shards)):
            header, flat, nbytes = recv_frame(s, self.compressor, reply=True, timeout_s=self.timeout_s,
                                              what=self._what(s, "waiting for parameters from"))
            if header[0] != Op.PARAMS:
                raise PSError(f"{self._what(s, 'got op ' + str(header[0]) + ' from')}, expected PARAMS")
            drift = header[2] - self._versions[i] - 1
            if self.clock:  # how many other updates landed since our last pull (async drift)
                self.stats.staleness[max(drift, 0)] = self.stats.staleness.get(max(drift, 0), 0) + 1
            self._versions[i] = header[2]
            self.stats.pull_bytes += nbytes
            if flat is None:
                continue
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        self.stats.pull_s += time.perf_counter() - t0

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
            _, nbytes = send_frame(s, Op.PUSH, clock=self.clock, version=self._versions[i], tensor=flat,
                                   compressor=self.compressor, timeout_s=self.timeout_s,
                                   what=self._what(s, "pushing to"))
            self.stats.push_bytes += nbytes
        self.clock += 1
        self.stats.steps += 1
        self.stats.push_s += time.perf_counter() - t0

    def close(self) -> None:
        """Tell the servers this worker is done (they stop waiting for it)."""
        if self._closed:
            return
        self._closed = True
        for s in self.servers:
            send_frame(s, Op.DONE, clock=self.clock, timeout_s=self.timeout_s, what=self._what(s, "leaving"))


def roles(world_size: int, num_servers: int) -> tuple[list[int], list[int]]:
    """``(servers, workers)``: the first ``num_servers`` ranks serve, the rest work."""
    if not 1 <= num_servers < world_size:
        raise ValueError(f"num_servers={num_servers} must be between 1 and world size - 1 = {world_size - 1} "
                         "(at least one rank must be a worker); e.g. phalanx run -np 3 --servers 1")
    return list(range(num_servers)), list(range(num_servers, world_size))


def run_ps(model_fn, optimizer_fn, train_fn, *, num_servers: int | None = None, mode: str = "sync",
           staleness: int = 0, staleness_lr: bool = False, compression=None, timeout: float | None = None,
           checkpoint_dir: str | None = None, checkpoint_every: int = 0, resume_from: str | None = None) -> dict:
    """Run this rank's role (``phalanx.init()`` done). Returns ``{"role", "stats", "result"}``.

    ``model_fn()`` must build the same model on every rank (seed it); ``train_fn(worker)``
    runs on workers and its return value is ``result``. ``num_servers`` defaults to
    PHALANX_NUM_SERVERS (set by ``phalanx run --servers N``), else 1.
    """
    import phalanx

    topo = phalanx.topology()
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {MODES}")
    if num_servers is None:
        num_servers = int(os.environ.get("PHALANX_NUM_SERVERS", "1"))
    servers, workers = roles(topo.size, num_servers)
    timeout_s = topo.timeout_s if timeout is None else float(timeout)
    model = model_fn()
    if topo.rank in servers:
        server = ParameterServer(model, optimizer_fn, servers=servers, workers=workers, mode=mode,
                                 staleness=staleness, staleness_lr=staleness_lr, compression=compression,
                                 timeout_s=timeout_s, checkpoint_dir=checkpoint_dir,
                                 checkpoint_every=checkpoint_every)
        if resume_from:
            server.load(resume_from)
        stats = server.serve().as_dict()
        phalanx.barrier()  # a later session's messages must not reach this server loop
        return {"role": "server", "stats": stats, "result": None}
    worker = PSWorker(model, servers=servers, workers=workers, compression=compression, timeout_s=timeout_s)
    try:
        result = train_fn(worker)
    finally:
        worker.close()
    phalanx.barrier()
    return {"role": "worker", "stats": worker.stats.as_dict(), "result": result}
