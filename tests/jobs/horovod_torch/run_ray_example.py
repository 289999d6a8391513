"""Run one of Horovod's Ray examples on a local Ray cluster: ``python run_ray_example.py EXAMPLE [ARGS...]``.

The examples connect to a running cluster (``ray.init(address="auto")``); here that call starts a local one
instead, ``ray.init(num_cpus=4, num_gpus=2)`` (``PHALANX_TEST_RAY_CPUS`` / ``_GPUS``). The GPUs are Ray's
logical ones: ``use_gpu=True`` (both examples hard-code it) reserves one per worker and Ray gives each
actor an id, while the CPU build of torch computes on the CPU (``torch.cuda.is_available()`` is False).
Nothing else of the example changes.
"""

import os
import runpy
import sys

import ray

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))  # tests/jobs: ray_local

from ray_local import start_local_ray  # noqa: E402

_real_init = ray.init


def _local_init(address=None, **kwargs):
    if address != "auto" or os.environ.get("RAY_ADDRESS"):
        return _real_init(address=address, **kwargs)
    start_local_ray(_real_init_module, num_cpus=int(os.environ.get("PHALANX_TEST_RAY_CPUS", "4")),
                    num_gpus=int(os.environ.get("PHALANX_TEST_RAY_GPUS", "2")))


class _real_init_module:  # start_local_ray calls .init and .shutdown on what it is given
    init = staticmethod(_real_init)
    shutdown = staticmethod(ray.shutdown)


def main() -> None:
    example, *args = sys.argv[1:]
    ray.init = _local_init
    sys.argv = [example, *args]
    try:
        runpy.run_path(example, run_name="__main__")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
