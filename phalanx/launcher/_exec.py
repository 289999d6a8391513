"""Exec shim between the elastic agent and a worker command. Imports nothing heavy.

It runs as ``python .../_exec.py CMD ARGS…`` (by path, so the phalanx package and
torch are not imported), and before it replaces itself with the command it

* exports the per-rank variables scripts written for Horovod read
  (HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, …), derived from the agent's RANK etc.;
* asks the kernel to SIGKILL the worker if the agent dies (PR_SET_PDEATHSIG), so a
  killed launcher leaves no orphan workers behind.
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        sys.exit("phalanx: no command to run")
    env = os.environ
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
    from tf_config import tf_config  # sibling module (this shim runs by path); stdlib only

    if "TF_CONFIG" not in env and (config := tf_config(env)):
        env["TF_CONFIG"] = config  # tf.distribute.MultiWorkerMirroredStrategy scripts run unedited
    env["PHALANX_LAUNCHER"] = "run"
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
