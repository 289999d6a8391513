"""Exec shim between the elastic agent and a worker command. Imports nothing heavy.

It runs as ``python .../_exec.py CMD ARGS…`` (by path, so neither the phalanx package's
``__init__`` nor torch is imported: that would cost every worker start about 2 s of CPU and
300 MB before its own script began; ``worker_env`` reads phalanx.settings under a bare
package, see :func:`_bare_phalanx`), and before it replaces itself with the command it

* exports the per-rank variables scripts written for Horovod read
  (HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, …), derived from the agent's RANK etc.;
* asks the kernel to SIGKILL the worker if the agent dies (PR_SET_PDEATHSIG), so a
  killed launcher leaves no orphan workers behind.
"""

import ctypes
import os
import signal
import sys
import types
from collections.abc import MutableMapping

_PR_SET_PDEATHSIG = 1


def _bare_phalanx() -> None:
    """Make ``import phalanx.settings`` load the settings package alone (standard library only),
    not phalanx's ``__init__`` and torch: a package object without the ``__init__`` run. The
    shim execs the worker's command next, so this stand-in never reaches a user's program."""
    if "phalanx" not in sys.modules:
        bare = types.ModuleType("phalanx")
        bare.__path__ = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
        sys.modules["phalanx"] = bare


def worker_env(env: MutableMapping[str, str]) -> None:
    """Add to ``env`` what a worker's script may read: Horovod's per-rank variables and TF_CONFIG."""
    for ours, theirs in (
        ("RANK", "HOROVOD_RANK"),
        ("WORLD_SIZE", "HOROVOD_SIZE"),
        ("LOCAL_RANK", "HOROVOD_LOCAL_RANK"),
        ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"),
        ("GROUP_RANK", "HOROVOD_CROSS_RANK"),
        ("GROUP_WORLD_SIZE", "HOROVOD_CROSS_SIZE"),
    ):
        if ours in env:
            env.setdefault(theirs, env[ours])
    env.setdefault("HOROVOD_HOSTNAME", os.uname().nodename)
    _bare_phalanx()
    # a sibling module (this shim runs by path); it reads phalanx.settings
    from tf_config import tf_config

    if "TF_CONFIG" not in env and (config := tf_config(env)):
        env["TF_CONFIG"] = config  # tf.distribute.MultiWorkerMirroredStrategy scripts run unedited
    env["PHALANX_LAUNCHER"] = "run"


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        sys.exit("phalanx: no command to run")
    worker_env(os.environ)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        sys.exit(f"phalanx: command not found: {argv[0]!r} (is it on PATH in the worker's environment?)")


if __name__ == "__main__":
    main()
