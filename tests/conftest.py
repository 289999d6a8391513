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
# 2026-11-27 11:26, 2 test processes, the whole suite 1075 s); modules not listed take under 11 s. Only the order depends on it: longest first
# (LPT), so a long module does not start last and keep one process running alone at the end.
MODULE_SECONDS = {
    "test_horovod_elastic_flow": 162, "test_keras": 158, "test_elastic_membership": 122,
    "test_elastic_inprocess": 108, "test_tune": 85, "test_ray": 73, "test_gpu_dry_run": 70, "test_launcher": 63,
    "test_elastic": 61, "test_slurm_elastic": 61, "test_trainer": 61, "test_tensorflow_horovod_examples": 58,
    "test_multihost": 52, "test_slurm_docs": 52, "test_preempt_slurm": 50, "test_runtime": 46,
    "test_big_models_grid": 45, "test_cli": 44, "test_stall": 44, "test_elastic_zero": 39, "test_horovod": 39,
    "test_elastic_snapshot_every": 37, "test_tensorflow": 32, "test_preempt_elastic": 32, "test_ps": 31,
    "test_big_models_3d": 29, "test_preempt": 28, "test_tensorflow_horovod": 27, "test_compressed_collectives": 26,
    "test_horovod_errors": 25, "test_elastic_random": 24, "test_preempt_restart": 23, "test_profiler": 22,
    "test_slurm": 22, "test_big_models": 20, "test_mpirun": 17, "test_zero": 16, "test_autotune": 16,
    "test_checkpoint_format": 15, "test_checkpoint": 14, "test_data_parallel_args": 14, "test_expert": 13,
    "test_ps_protocol": 12,
}


def pytest_collection_modifyitems(config, items):
    """Longest modules first; within a module, the order the file gives (a stable sort)."""
    def seconds(item):
        return MODULE_SECONDS.get(item.path.stem, 0)
    items.sort(key=lambda item: -seconds(item))
