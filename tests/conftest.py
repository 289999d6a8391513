"""Suite-wide settings: spawned ranks fork from a server that already imported what most tests use."""

import importlib.util
import os

if importlib.util.find_spec("sklearn") is not None:
    os.environ.setdefault("PHALANX_SPAWN_PRELOAD", "sklearn.datasets")


# A gloo process group that took part in an optimizer step keeps its worker threads after
# destroy_process_group() (plain torch 2.13 reproduces it: init gloo, one SGD step, destroy:
# 'pt_gloo_runloop' threads remain). A process then sometimes aborts in C++ teardown after its
# script finished ("terminate called without an active exception", pytorch/pytorch#190489):
# 3 of 12 runs under CPU load, 0 of 12 quiet. Tests that launch whole jobs retry once on exactly
# that signature; any other failure, or the same one twice, still fails the test.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_job(cmd, **kwargs):
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, retried once on the upstream teardown abort."""
    import subprocess

    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    return proc
