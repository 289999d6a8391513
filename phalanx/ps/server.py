"""Parameter server: one rank holds a shard of the parameters and applies the optimizer to it.

Li et al., "Scaling Distributed Machine Learning with the Parameter Server" (OSDI 2014);
bounded staleness (SSP) after Ho et al., "More Effective Distributed ML via a Stale
Synchronous Parallel Parameter Server" (NeurIPS 2013); staleness-aware learning rate
after Zhang et al., "Staleness-aware Async-SGD for Distributed Deep Learning" (IJCAI 2016).

Data flow (S servers, W workers; every worker talks to every server)::

    worker w                         server s (shard s of the parameters)
    ──────────                       ───────────────────────────────────
    PULL(clock c)  ───────────────▶  grant when the mode allows (below), else hold
                   ◀───────────────  PARAMS(version v) = shard, compressed
    forward/backward on its batch
    PUSH(clock c, pulled v) ───────▶ sync : add to the clock's sum; when every active
                                            worker pushed, average and step once
                                     async/ssp: step at once (lr / staleness optional)

    grant a PULL at clock c:  sync  when version >= c        (exactly synchronous SGD)
                              ssp   when c - min_clock <= s  (no one > s steps ahead)
                              async always                    (Hogwild-style)

Parameters are split across servers by size (largest first to the least-loaded
server), so each server owns whole tensors and any ``torch.optim`` optimizer runs
unchanged on its shard.

Example::

    server = ParameterServer(model, lambda ps: torch.optim.SGD(ps, lr=0.1),
                             servers=[0], workers=[1, 2], mode="ssp", staleness=2)
    stats = server.serve()              # returns when every worker sent DONE
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch
from torch import nn

from phalanx.comm.compression.codecs import get_compressor
from phalanx.comm.compression.error_feedback import ErrorFeedback
from phalanx.log import get_logger
from phalanx.ps.protocol import (
    MetaCache,
    Op,
    PSError,
    pack,
    recv_body,
    recv_header,
    send_frame,
    wait_work,
)
from phalanx.runtime.jobkey import job_key

__all__ = ["ParameterServer", "ServerStats", "shard_parameters", "MODES"]

MODES = ("sync", "async", "ssp")
_log = get_logger(__name__)


def shard_parameters(sizes: dict[str, int], num_servers: int) -> list[list[str]]:
    """Assign parameter names to servers, balancing element counts (LPT greedy).

    Example::

        shard_parameters({"w": 100, "b": 10, "v": 90}, 2)   # [["w"], ["b", "v"]]
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    loads = [0] * num_servers
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], list(sizes).index(n))):
        s = min(range(num_servers), key=lambda i: (loads[i], i))
        owner[name] = s
        loads[s] += sizes[name]
    # Keep model order inside a shard so flattening is the same on both sides.
    return [[n for n in sizes if owner[n] == s] for s in range(num_servers)]


@dataclasses.dataclass
class ServerStats:
    """What one server saw: load, bytes, staleness of pushes and how far ahead pulls were."""

    server: int = 0
    pushes: int = 0
    pulls: int = 0
    updates: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    held_pulls: int = 0
    version: int = 0  # updates applied to the shard, over every session (restored from checkpoints)
    staleness: dict[int, int] = dataclasses.field(default_factory=dict)  # histogram
    clock_gap: dict[int, int] = dataclasses.field(default_factory=dict)  # c - min_clock at each grant
    max_in_flight: int = 0  # most replies to one worker sent and not yet acknowledged as read
    max_gap: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class ParameterServer:
    """Serve one shard of ``model``'s parameters to the workers until they are all done.

    Args:
        model: a model with the initial parameters (only this server's shard is kept).
        optimizer_fn: ``params -> torch.optim.Optimizer``, applied to the shard.
        servers, workers: global ranks of the server and worker roles.
        mode: ``"sync"``, ``"async"`` or ``"ssp"``; ``staleness`` is SSP's bound s.
        staleness_lr: divide the learning rate by a push's staleness (async / ssp).
        compression: name or Compressor for pulls and pushes (``"fp16"``, ...).
        timeout_s: seconds without any message before the server gives up.
        key: HMAC key of the frames' metas (default: the job secret, which ``phalanx run``
            makes; none in a plain ``phalanx.run``). A frame whose meta does not carry a
            valid HMAC under it is refused before it is decoded (:class:`PSAuthError`).

    Checkpoints: the server is a state piece (``state_dict`` / ``load_state_dict``);
    :func:`~phalanx.ps.run_ps` saves and restores it with a ``phalanx.checkpoint``
    manager when a session ends and starts.
    """

    def __init__(self, model: nn.Module, optimizer_fn, *, servers, workers, mode: str = "sync",
                 staleness: int = 0, staleness_lr: bool = False, compression=None,
                 timeout_s: float = 300.0, rank: int | None = None,
                 key: bytes | None = None) -> None:
        import torch.distributed as dist

        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: choose one of {MODES}")
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0 steps, got {staleness}")
        self.rank = dist.get_rank() if rank is None else rank
        self.servers, self.workers = list(servers), list(workers)
        if self.rank not in self.servers:
            raise ValueError(f"rank {self.rank} is not in servers={self.servers}")
        self.index = self.servers.index(self.rank)
        names = shard_parameters({n: p.numel() for n, p in model.named_parameters()}, len(self.servers))
        self.names = names[self.index]
        named = dict(model.named_parameters())
        self.params = [nn.Parameter(named[n].detach().clone()) for n in self.names]
        self.optimizer = optimizer_fn(self.params) if self.params else None
        self.mode, self.staleness, self.staleness_lr = mode, staleness, staleness_lr
        self.compressor = get_compressor(compression)
        # parameters are not gradients: no error-feedback residual on pulls, only the codec
        self.pull_compressor = (self.compressor.inner if isinstance(self.compressor, ErrorFeedback)
                                else self.compressor)
        # frame metas signed with the job secret (phalanx run makes one), checked before decoding
        self.cache = MetaCache(key=key if key is not None else job_key())
        self.timeout_s = timeout_s
        self.version = 0
        self.clocks = {w: 0 for w in self.workers}
        self.active = set(self.workers)
        self.stats = ServerStats(server=self.index)
        self._sum: torch.Tensor | None = None
        self._contributions = 0
        self._round = 0  # sync rounds completed in this session (clocks restart at 0 on resume)
        self._held: list[tuple[int, int]] = []  # (worker, clock) pulls not yet granted
        # replies in flight per worker, oldest first: (reply number, [(work, buffer), ...])
        self._sends: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._replied: dict[int, int] = collections.defaultdict(int)  # replies sent per worker
        self._packed: tuple[int, tuple] | None = None  # (version, payload): compressed once per version

    # -- shard <-> flat --------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        if not self.params:
            return torch.empty(0)
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _set_grads(self, grad_flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            # grad_flat is a fresh buffer per push (or the sync sum, dropped after the step): views suffice
            p.grad = grad_flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()

    def _apply(self, grad_flat: torch.Tensor, lr_scale: float = 1.0) -> None:
        if self.optimizer is not None:
            self._set_grads(grad_flat)
            saved = [g["lr"] for g in self.optimizer.param_groups] if lr_scale != 1.0 else None
            if saved:
                for g in self.optimizer.param_groups:
                    g["lr"] = g["lr"] * lr_scale
            self.optimizer.step()
            if saved:
                for g, lr in zip(self.optimizer.param_groups, saved):
                    g["lr"] = lr
        self.version += 1
        self.stats.updates += 1
        self.stats.version = self.version

    # -- the loop --------------------------------------------------------------------------
    def serve(self) -> ServerStats:
        """Answer workers until every one has sent DONE; returns this server's statistics."""
        while self.active:
            t0 = time.perf_counter()
            silent = sorted(self.active)
            header, src = recv_header(
                None, reply=False, timeout_s=self.timeout_s,
                what=f"server rank {self.rank} waiting for workers {silent} (mode={self.mode})")
            t1 = time.perf_counter()
            self.stats.idle_s += t1 - t0
            op = header[0]
            self._release(src, header[6])
            if src not in self.clocks:
                raise PSError(f"server rank {self.rank}: message from rank {src}, which is not a worker "
                              f"(workers={self.workers}); did two jobs share ranks?")
            if src not in self.active:
                raise PSError(f"server rank {self.rank}: worker rank {src} sent op {op} after DONE; "
                              "a new session began before this one ended (run_ps ends with a barrier)")
            if op == Op.PULL:
                self._on_pull(src, header[1])
            elif op == Op.PUSH:
                self._on_push(src, header)
                if header[5]:  # the worker's next pull rides on this push
                    self._on_pull(src, header[1] + 1)
            elif op == Op.DONE:
                self.active.discard(src)
                self._maybe_step_sync()
            else:
                raise PSError(f"server rank {self.rank}: unknown op {op} from rank {src}")
            self._grant_held()
            self.stats.busy_s += time.perf_counter() - t1
        for w in list(self._sends):
            self._drain(w)
        return self.stats

    def _on_pull(self, src: int, clock: int) -> None:
        self.stats.pulls += 1
        if not self._grantable(clock):
            self.stats.held_pulls += 1
        self._held.append((src, clock))

    def _on_push(self, src: int, header: list[int]) -> None:
        grad_flat, nbytes = recv_body(src, header, self.compressor, reply=False, timeout_s=self.timeout_s,
                                      cache=self.cache,
                                      what=f"server rank {self.rank} receiving a push from worker rank {src}")
        self.stats.pushes += 1
        self.stats.bytes_in += nbytes
        clock, pulled_version = header[1], header[2]
        if clock != self.clocks[src]:
            raise PSError(f"server rank {self.rank}: worker rank {src} pushed clock {clock}, expected "
                          f"{self.clocks[src]} (push() twice without pull()?)")
        self.clocks[src] = clock + 1
        staleness = self.version - pulled_version
        self.stats.staleness[staleness] = self.stats.staleness.get(staleness, 0) + 1
        grad_flat = grad_flat.float() if grad_flat is not None else torch.empty(0)
        if self.mode == "sync":
            self._sum = grad_flat.clone() if self._sum is None else self._sum.add_(grad_flat)
            self._contributions += 1
            self._maybe_step_sync()
        else:
            scale = 1.0 / max(1, staleness) if self.staleness_lr else 1.0
            self._apply(grad_flat, scale)

    def _maybe_step_sync(self) -> None:
        if self.mode != "sync" or self._sum is None:
            return
        pending = [w for w in self.active if self.clocks[w] == self._round]
        if pending:  # some active worker has not pushed this clock yet
            return
        self._apply(self._sum.div_(self._contributions))
        self._sum, self._contributions = None, 0
        self._round += 1

    def _grantable(self, clock: int) -> bool:
        if self.mode == "async":
            return True
        if self.mode == "sync":
            return self._round >= clock
        slowest = min((self.clocks[w] for w in self.active), default=clock)
        return clock - slowest <= self.staleness

    def _grant_held(self) -> None:
        still = []
        for worker, clock in self._held:
            if not self._grantable(clock):
                still.append((worker, clock))
                continue
            slowest = min((self.clocks[w] for w in self.active), default=clock)
            gap = max(0, clock - slowest)
            self.stats.clock_gap[gap] = self.stats.clock_gap.get(gap, 0) + 1
            self.stats.max_gap = max(self.stats.max_gap, gap)
            if self._packed is None or self._packed[0] != self.version:
                self._packed = (self.version, pack(self._flat(), self.pull_compressor))
            works, nbytes = send_frame(worker, Op.PARAMS, clock=clock, version=self.version,
                                       packed=self._packed[1], reply=True, cache=self.cache, wait=False)
            self._sends[worker].append((self._replied[worker], works))
            self._replied[worker] += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, len(self._sends[worker]))
            self.stats.bytes_out += nbytes
        self._held = still

    def _release(self, worker: int, read: int) -> None:
        """Wait on (and so free) the sends of the replies ``worker`` says it has read: they are
        delivered, so the waits return at once. gloo reports a send complete only once waited on,
        so this acknowledgement is what bounds the replies (and parameter copies) kept alive."""
        pending = self._sends.get(worker)
        while pending and pending[0][0] < read:
            for work, _buf in pending.popleft()[1]:
                wait_work(work, self.timeout_s, f"server rank {self.rank} sending parameters to worker rank {worker}")

    def _drain(self, worker: int) -> None:
        """Wait for every reply to ``worker`` still in flight (the end of a session)."""
        self._replied.pop(worker, None)  # a next session's worker counts its reads from 0
        for _number, works in self._sends.pop(worker, ()):
            for work, _buf in works:
                wait_work(work, self.timeout_s, f"server rank {self.rank} sending parameters to worker rank {worker}")

    # -- checkpoint (through phalanx.checkpoint: run_ps hands this object to a CheckpointManager) --
    def state_dict(self) -> dict:
        """This shard: parameters by name, optimizer state, version. Tensors and plain values only."""
        return {
            "names": list(self.names),
            "params": {n: p.detach().clone() for n, p in zip(self.names, self.params)},
            "optimizer": self.optimizer.state_dict() if self.optimizer else {},
            "version": self.version,
            "mode": self.mode,
        }

    def load_state_dict(self, state: dict) -> None:
        if list(state["names"]) != self.names:
            raise PSError(f"server rank {self.rank}: checkpoint holds {state['names']} but this shard is "
                          f"{self.names}; restore with the same model and number of servers")
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(state["params"][n])
        if self.optimizer and state["optimizer"]:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = self.stats.version = int(state["version"])
