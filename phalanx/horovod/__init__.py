"""A drop-in home for ``horovod.torch`` scripts: ``import phalanx.horovod.torch as hvd``.

The API lives in :mod:`phalanx.horovod.torch` (Horovod's own module path);
``import phalanx.horovod as hvd`` is the same API. Thin by design: every call translates
Horovod's spelling and delegates to phalanx's core (``phalanx.comm``, ``phalanx.parallel``,
``phalanx.elastic``, ``phalanx.profiler``); the core never imports this package.
docs/horovod.md lists every call as "same", "same, faster" or "differs: how".

Example (seed 002's script, only the import changed)::

    import phalanx.horovod.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Horovod's submodule paths import too: ``from phalanx.horovod.torch.elastic.sampler import
ElasticSampler`` (and ``...torch.elastic``, ``...torch.elastic.state``) are
:mod:`phalanx.horovod.elastic` and its submodules, registered here under Horovod's names
(``phalanx.horovod.torch`` is a module, not a package: only a registered name resolves below it).
"""

import sys as _sys

from phalanx.horovod.elastic import sampler as _sampler  # noqa: F401 - the submodules, for the names below
from phalanx.horovod.elastic import state as _state  # noqa: F401
from phalanx.horovod.torch import *  # noqa: F401,F403
from phalanx.horovod.torch import __all__  # noqa: F401

for _name in ("elastic", "elastic.sampler", "elastic.state"):
    _sys.modules.setdefault(f"{__name__}.torch.{_name}", _sys.modules[f"{__name__}.{_name}"])
