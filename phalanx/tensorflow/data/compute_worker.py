"""Horovod's ``horovod.tensorflow.data.compute_worker``: the compute job of the tf.data service.

``phalanx run -np N python -m phalanx.tensorflow.data.compute_worker CONFIG [--dispatchers D]
[--dispatcher-side compute|training] [--timeout S]``: rank 0 starts the
:class:`~phalanx.tensorflow.data.compute_service.ComputeService` and writes ``CONFIG`` (the training
job reads it); every rank runs a tf.data worker (and, compute side, every ``N / D``-th a
dispatcher) until a training rank calls ``config.compute_client().shutdown()``.

Example::

    phalanx run -np 2 python -m phalanx.tensorflow.data.compute_worker /tmp/compute.json &
    phalanx run -np 2 python tensorflow2_mnist_data_service.py /tmp/compute.json
"""

from __future__ import annotations

import argparse

import phalanx.tensorflow as hvd
from phalanx.tensorflow.data.compute_service import (
    ComputeService,
    TfDataServiceConfig,
    compute_worker_fn,
    make_secret_key,
)


def main(dispatchers: int, dispatcher_side: str, configfile: str, timeout: int) -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if dispatchers < 1 or size % dispatchers:
        raise SystemExit(f"compute_worker: the number of processes ({size}) must be a multiple of --dispatchers "
                         f"({dispatchers})")
    if dispatcher_side not in ("compute", "training"):
        raise SystemExit(f"compute_worker: --dispatcher-side is 'compute' or 'training', got {dispatcher_side!r}")
    service = None
    try:
        config = None
        if rank == 0:
            key = make_secret_key()
            service = ComputeService(dispatchers, size // dispatchers, key=key)
            config = TfDataServiceConfig(dispatchers=dispatchers, workers_per_dispatcher=size // dispatchers,
                                         dispatcher_side=dispatcher_side, addresses=service.addresses(), key=key,
                                         timeout=timeout)
            config.write(configfile)
        config = hvd.broadcast_object(config, name="TfDataServiceConfig")
        compute_worker_fn(config)
    finally:
        if service is not None:
            service.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configfile", help="where to write the compute service's config file")
    parser.add_argument("--dispatchers", type=int, default=1, help="number of tf.data dispatchers")
    parser.add_argument("--dispatcher-side", default="compute", dest="dispatcher_side",
                        help="where the dispatchers run: 'compute' or 'training'")
    parser.add_argument("--timeout", type=int, default=60, help="seconds to set up and connect everything")
    args = parser.parse_args()
    main(args.dispatchers, args.dispatcher_side, args.configfile, args.timeout)
