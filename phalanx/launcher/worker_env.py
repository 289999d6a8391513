"""The environment an in-process elastic worker starts with (:class:`phalanx.launcher.supervisor.Supervisor`).

The launcher's own environment less the per-rank variables (a worker learns its rank from the
generation it joins), the job's extra variables, the store's address, the heartbeat period, and a
``PYTHONPATH`` that makes the workers import the phalanx this launcher runs.
"""

from __future__ import annotations

import os
import site

from phalanx.elastic import inprocess
from phalanx.runtime.heartbeat import HEARTBEAT_ENV, HEARTBEAT_STORE_ENV

__all__ = ["PER_RANK_VARS", "worker_env"]

PER_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "HOROVOD_RANK",
                 "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
"""set per worker (or learnt at a re-form), never inherited from the launcher"""


def worker_env(extra: dict[str, str], run_id: str, addr: str, port: int, workers: int,
               heartbeat_timeout: float) -> dict[str, str]:
    """A worker's environment: ``extra`` (the job's ``-x`` variables) over the launcher's, the store at
    ``addr:port``, ``OMP_NUM_THREADS`` as this machine's cores over ``workers`` unless set, and the
    heartbeat every sixth of ``heartbeat_timeout`` (at most a second)."""
    env = {k: v for k, v in os.environ.items() if k not in PER_RANK_VARS}
    env.update(extra)
    # the workers import the phalanx this launcher runs (also an uninstalled checkout); a site-packages
    # install is on their path already, and on PYTHONPATH would come ahead of the standard library
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in {*site.getsitepackages(), site.getusersitepackages()}:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(workers, 1))))
    env.update({"PHALANX_LAUNCHER": "run", "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "true",
                "MASTER_ADDR": addr, "MASTER_PORT": str(port), inprocess.STORE_ENV: f"{addr}:{port}",
                HEARTBEAT_ENV: f"{min(1.0, heartbeat_timeout / 6):g}", HEARTBEAT_STORE_ENV: f"{addr}:{port}"})
    return env
