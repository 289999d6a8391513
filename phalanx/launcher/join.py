"""What a rank does to join a job: the runtime's ``init``, then the services the launch asked for.

``phalanx run --timeline FILE`` exports PHALANX_TIMELINE and ``--autotune`` exports
PHALANX_AUTOTUNE; a rank starts the timeline and the bucket tuner when it joins.
The runtime never imports these services: this module, on the launcher floor, is
where the launch's wishes meet them. ``phalanx.init`` and ``phalanx.run``'s ranks
both call :func:`join`.

Example::

    from phalanx.launcher.join import join
    topo = join()          # same as phalanx.init()
"""

from __future__ import annotations

import os

from phalanx import runtime

__all__ = ["join"]


def join(backend=None, device=None, timeout=None) -> runtime.Topology:
    """Initialise the runtime (see :func:`phalanx.runtime.init`) and start the services the environment names."""
    topo = runtime.init(backend=backend, device=device, timeout=timeout)
    if os.environ.get("PHALANX_TIMELINE"):
        from phalanx.profiler.timeline import start_from_env

        start_from_env(topo.rank)
    if os.environ.get("PHALANX_AUTOTUNE") or os.environ.get("HOROVOD_AUTOTUNE"):
        from phalanx.planner.autotune import enable_from_env

        enable_from_env()
    return topo
