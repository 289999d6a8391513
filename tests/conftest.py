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

# Seconds per module on this 2-core machine (`python -m pytest -q --durations=0`, summed per module,
# run ending 2026-11-27 18:23, 2 test processes, the whole suite 1280 s; the modules ci-time changed: that figure
# less 1.5x what each saved run alone; the first eight as the last full run before ci-time2 measured them,
# the suite 1211 s); modules not listed take under 11 s. Only the order depends on it:
# longest first (LPT), so a long module does not start last and keep one process running alone at the end.
MODULE_SECONDS = {
    "test_ray": 271, "test_horovod_elastic_flow": 157, "test_elastic_inprocess": 155, "test_keras": 148,
    "test_elastic_membership": 118, "test_tensorflow_horovod_examples": 104, "test_gpu_dry_run": 96,
    "test_cli": 92, "test_elastic": 75, "test_multihost": 71, "test_launcher": 63, "test_stall": 63,
    "test_elastic_snapshot_every": 63, "test_trainer": 60, "test_preempt_slurm": 59, "test_ps": 52,
    "test_slurm_elastic": 50, "test_slurm_docs": 49, "test_big_models_grid": 41,
    "test_preempt": 41, "test_tensorflow_horovod": 38, "test_profiler": 37, "test_elastic_zero": 36,
    "test_big_models_3d": 35, "test_runtime": 32, "test_tune": 31, "test_preempt_elastic": 31,
    "test_preempt_restart": 29, "test_elastic_random": 27, "test_big_models": 26, "test_horovod_errors": 23,
    "test_mpirun": 23, "test_tensorflow": 20, "test_slurm": 20, "test_compressed_collectives": 18,
    "test_horovod_example": 17, "test_horovod": 17, "test_checkpoint": 17, "test_expert": 17,
    "test_data_parallel_args": 16, "test_zero": 15, "test_parallelize": 15, "test_autotune": 15,
    "test_checkpoint_format": 13, "test_ps_protocol": 13, "test_backends": 12, "test_pipeline": 11,
}


def pytest_collection_modifyitems(config, items):
    """Longest modules first; within a module, the order the file gives (a stable sort)."""
    def seconds(item):
        return MODULE_SECONDS.get(item.path.stem, 0)
    items.sort(key=lambda item: -seconds(item))
