"""What a rank does to join a job: the runtime's ``init``, then the services the launch asked for.

``phalanx run --timeline FILE`` exports PHALANX_TIMELINE and ``--autotune`` exports
PHALANX_AUTOTUNE; a rank starts the timeline and the bucket tuner when it joins.
The runtime never imports these services: this module, on the launcher floor, is
where the launch's wishes meet them. ``phalanx.init`` and ``phalanx.run``'s ranks
both call :func:`join`.

Example::

    from phalanx.launcher.startup import join
    topo = join()          # same as phalanx.init()
"""

from __future__ import annotations

import os

from phalanx import runtime
from phalanx.log import get_logger
from phalanx.runtime.heartbeat import start_from_env as start_heartbeat

__all__ = ["join"]

log = get_logger(__name__)


def join(backend=None, device=None, timeout=None) -> runtime.Topology:
    """Initialise the runtime (see :func:`phalanx.runtime.init`) and start the services the environment names."""
    topo = runtime.init(backend=backend, device=device, timeout=timeout)
    job = runtime.current_settings()
    start_heartbeat(topo.rank)  # under `phalanx run`: the launcher watches it for stalls (launcher/stall.py)
    # INFO at --verbose: what a user debugging a job asks first (which rank am I, where, on what)
    log.info("joined: rank %d of %d, local rank %d of %d, host %d of %d; backend %s on %s; collective "
             "timeout %.0f s; started by %s", topo.rank, topo.size, topo.local_rank, topo.local_size,
             topo.cross_rank, topo.cross_size, topo.backend, topo.device, topo.timeout_s,
             job.runtime.launcher or ("torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "?"))
    if topo.rank == 0 and topo.cross_size > 1:
        log.info("hosts (global ranks per host): %s", [list(h) for h in topo.hosts])
    if job.launcher.timeline:
        from phalanx.profiler.timeline import start_from_env

        start_from_env(topo.rank)
        log.info("timeline: writing %s.rank%d at exit", job.launcher.timeline, topo.rank)
    if job.data_parallel.autotune:
        from phalanx.planner.autotune import enable_from_env

        if enable_from_env() and topo.rank == 0:
            log.info("autotune: on (every gradient engine tunes its bucket size during the first steps)")
    return topo
