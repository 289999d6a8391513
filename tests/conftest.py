"""Suite-wide settings: spawned ranks fork from a server that already imported what most tests use;
the slowest modules start first, so the test processes (pytest-xdist, a module each) end together.

The tests mirror the package (runtime/, comm/, parallel/, ps/, services/, launcher/, fronts/; the
scripts they launch in jobs/). Every one of those folders is on ``sys.path`` from the start: a
rank unpickles its test body by module name, in a process forked from a server that started
with the path of that moment, so a folder added later (pytest adds a module's folder when it
imports it) would be missing there.

Markers, set per module (``pytestmark``): ``unit`` (one process), ``ranks`` (real ranks on gloo),
``cluster`` (cluster software: SLURM, Open MPI, sshd in network namespaces, Ray, Optuna's
studies). ``python -m pytest -m unit`` is the quick loop.
"""

import importlib.util
import os
import pathlib
import sys

_TESTS = pathlib.Path(__file__).resolve().parent
for _folder in sorted(p for p in _TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

if importlib.util.find_spec("sklearn") is not None:
    os.environ.setdefault("PHALANX_SPAWN_PRELOAD", "sklearn.datasets")

# Seconds per module (`python -m pytest -q --durations=0`, summed per module; the full suite of 2026-11-27
# 23:05, 2 test processes, 879 s on an AVX-512 2-core machine); modules not listed take under 8 s. Only the
# order depends on it: longest first (LPT), so a long module does not start last and keep one process
# running alone at the end.
MODULE_SECONDS = {
    "test_elastic_membership": 148, "test_ray": 128, "test_horovod_elastic_flow": 92, "test_keras": 89,
    "test_elastic_inprocess": 85, "test_tensorflow_horovod_examples": 61, "test_gpu_dry_run": 58,
    "test_preempt_slurm": 54, "test_ps": 49, "test_elastic_zero": 47, "test_multihost": 46,
    "test_launcher": 43, "test_stall": 41, "test_slurm_elastic": 39, "test_big_models_grid": 39,
    "test_big_models_3d": 38, "test_slurm_docs": 38, "test_preempt": 37, "test_elastic": 35,
    "test_elastic_snapshot_every": 34, "test_cli": 32, "test_trainer": 30, "test_mpirun": 28, "test_tune": 26,
    "test_runtime": 25, "test_preempt_restart": 25, "test_profiler": 23, "test_elastic_random": 23,
    "test_tensorflow": 20, "test_tensorflow_horovod": 20, "test_horovod_errors": 18, "test_big_models": 18,
    "test_slurm": 17, "test_compressed_collectives": 16, "test_horovod": 14, "test_preempt_elastic": 13,
    "test_horovod_example": 13, "test_checkpoint": 12, "test_zero": 12, "test_ps_protocol": 11,
    "test_expert": 10, "test_checkpoint_format": 9, "test_parallelize": 9, "test_data_parallel_args": 9
}


def pytest_collection_modifyitems(config, items):
    """Longest modules first; within a module, the order the file gives (a stable sort)."""
    def seconds(item):
        return MODULE_SECONDS.get(item.path.stem, 0)
    items.sort(key=lambda item: -seconds(item))
