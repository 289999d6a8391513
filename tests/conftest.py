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
# 2026-11-27 06:10, 2 test processes, the whole suite 1147 s); modules not listed take under 11 s. Only the order depends on it: longest first
# (LPT), so a long module does not start last and keep one process running alone at the end.
MODULE_SECONDS = {
    "test_horovod_elastic_flow": 168, "test_keras": 156, "test_elastic_membership": 153,
    "test_elastic_inprocess": 126, "test_cli": 98, "test_tensorflow_horovod_examples": 87, "test_launcher": 87,
    "test_ray": 86, "test_preempt_slurm": 78, "test_tune": 77, "test_gpu_dry_run": 75, "test_trainer": 70,
    "test_multihost": 58, "test_horovod": 50, "test_stall": 50, "test_elastic_snapshot_every": 48,
    "test_elastic": 45, "test_slurm_docs": 44, "test_elastic_zero": 41, "test_slurm_elastic": 38, "test_runtime": 36,
    "test_tensorflow": 33, "test_elastic_random": 31, "test_ps": 31, "test_horovod_errors": 27,
    "test_preempt_restart": 27, "test_preempt_elastic": 25, "test_big_models": 25, "test_big_models_grid": 24,
    "test_big_models_3d": 36,  # 8 ranks; measured alone (--durations, load ~10), not in a full run
    "test_compressed_collectives": 22, "test_mpirun": 22, "test_preempt": 22, "test_slurm": 22,
    "test_tensorflow_horovod": 21, "test_profiler": 20, "test_data_parallel_args": 20, "test_autotune": 17,
    "test_horovod_example": 15, "test_checkpoint_format": 14, "test_checkpoint": 13, "test_parallelize": 13,
    "test_expert": 12, "test_zero": 12, "test_ps_protocol": 12, "test_data_parallel": 12,
}


def pytest_collection_modifyitems(config, items):
    """Longest modules first; within a module, the order the file gives (a stable sort)."""
    def seconds(item):
        return MODULE_SECONDS.get(item.path.stem, 0)
    items.sort(key=lambda item: -seconds(item))
