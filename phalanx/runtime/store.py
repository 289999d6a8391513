"""The job's c10d store: a TCPStore bound to one address, kept for the life of the process.

Example::

    from phalanx.runtime.store import bound_tcp_store
    store = bound_tcp_store("127.0.0.1", 0, timeout=datetime.timedelta(seconds=60))
    store.set("k", "v"); print(store.port)
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from phalanx.log import get_logger
from phalanx.runtime.env import LaunchInfo

__all__ = ["bound_tcp_store", "rendezvous_store", "forget_stores"]


def bound_tcp_store(host: str, port: int, *, timeout: datetime.timedelta, world_size: int | None = None,
                    multi_tenant: bool = False) -> dist.TCPStore:
    """A TCPStore server that listens on ``host``'s address only, not on every interface.

    torch's TCPStore binds the wildcard address; a socket bound here and handed over
    through ``master_listen_fd`` keeps the store off other networks. ``port`` 0 picks a
    free one (read it back from ``store.port``). With ``multi_tenant=True`` a later
    ``TCPStore(..., multi_tenant=True)`` on the same port in this process (TorchElastic's
    rendezvous) reuses this server. Falls back to torch's default binding, with a log
    line, where the address cannot be bound or this torch lacks ``master_listen_fd``.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, world_size=world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, multi_tenant=multi_tenant, master_listen_fd=sock.detach())
    except (OSError, TypeError, RuntimeError, ValueError) as err:
        get_logger(__name__).info("store on %s:%s binds all addresses (%s)", host, port, err)
        return dist.TCPStore(host, port, world_size=world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False, multi_tenant=multi_tenant)
    return store  # the server owns the listening fd now (detached from the Python socket)


_stores: dict[tuple[str, int], dist.Store] = {}
_generation = 0


def rendezvous_store(info: LaunchInfo, timeout: datetime.timedelta) -> dist.Store:
    """The job's TCPStore, kept for the life of the process; each ``init()`` gets a fresh prefix.

    Re-using one store across shutdown/init avoids a race in which a fast rank
    reconnects to the store of the previous generation while rank 0 replaces it.
    Under torchrun or ``phalanx run`` the agent hosts the store and every worker
    is a client (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 hosts it.
    """
    global _generation
    key = (info.master_addr, info.master_port)
    if key not in _stores:
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        if info.rank == 0 and not agent_hosts:
            _stores[key] = bound_tcp_store(info.master_addr, info.master_port, timeout=timeout,
                                           world_size=info.size)
        else:
            _stores[key] = dist.TCPStore(info.master_addr, info.master_port, is_master=False, timeout=timeout,
                                         wait_for_workers=False)
    _generation += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"phalanx/r{restart}/g{_generation}", _stores[key])


def forget_stores() -> None:
    """Drop the kept stores (at interpreter exit, while the interpreter is whole)."""
    _stores.clear()
