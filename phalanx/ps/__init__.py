"""Asynchronous training: parameter server (sync / async / SSP) and local SGD.

Example::

    from phalanx.ps import run_ps, LocalSGD
    out = run_ps(model_fn, lambda ps: torch.optim.SGD(ps, lr=0.1), train_fn, mode="ssp", staleness=2)
    opt = LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, sync_every=8)

See docs/async.md for how to choose.
"""

from phalanx.ps.local_sgd import DiLoCo, LocalSGD
from phalanx.ps.protocol import PSError, PSPeerError, PSTimeoutError
from phalanx.ps.server import MODES, ParameterServer, ServerStats, shard_parameters
from phalanx.ps.worker import PSWorker, WorkerStats, roles, run_ps

__all__ = [
    "run_ps",
    "roles",
    "ParameterServer",
    "PSWorker",
    "ServerStats",
    "WorkerStats",
    "shard_parameters",
    "MODES",
    "PSError",
    "PSTimeoutError",
    "PSPeerError",
    "LocalSGD",
    "DiLoCo",
]
