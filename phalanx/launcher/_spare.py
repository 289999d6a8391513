"""A warm spare worker: the heavy imports done ahead, it becomes a replacement when told to.

A replacement worker started from nothing spends seconds before it can join: the interpreter,
``import torch``, ``torch._dynamo`` (torch.optim imports it; phalanx imports it before its first
group), phalanx. Measured on cpu2 (2 cores) with three survivors training beside it: 10.6 s of
the 11.0 s from a kill to a job back at full size at 4 workers (one run); with the spare, 0.7-0.9 s. With ``PHALANX_ELASTIC_SPARE=1`` the
supervisor keeps one such process ready (:mod:`phalanx.launcher.spare`)::

    supervisor: Popen(python _spare.py, the job's common env) ─ spare: import torch, dynamo, phalanx
                ─ wait for one line on stdin
    a worker lost: supervisor writes {"env": the replacement's env, "command": [...]} ─ stdin closed
    spare: os.environ = that env ─ Horovod's per-rank variables (as _exec.py) ─ run the command's
           script in this interpreter (runpy: `python [-u] script.py args`, `python [-u] -m mod args`);
           any other command is exec'd as _exec.py would (no time saved, nothing lost)

Runs by path (like _exec.py), so nothing of phalanx is imported before the line says this is a job.
"""

import ctypes
import json
import os
import runpy
import shutil
import signal
import sys

_PR_SET_PDEATHSIG = 1
_LAUNCHER_DIR = os.path.dirname(os.path.abspath(__file__))


def _preload() -> None:
    """What every worker imports first; a failure here only loses the head start."""
    try:
        import torch  # noqa: F401

        from phalanx.runtime import import_dynamo_first

        import_dynamo_first()
        import phalanx  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the command then imports (and reports) it itself
        print(f"phalanx: the warm spare could not preload ({type(err).__name__}: {err})", file=sys.stderr, flush=True)


def _in_process(command: list[str]) -> list[str] | None:
    """``command``'s arguments after the interpreter when this interpreter can run it in-process
    (the same Python, only ``-u`` before the script or ``-m``), else None."""
    exe = shutil.which(command[0]) if command else None
    if exe is None or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return None
    args = command[1:]
    while args and args[0] == "-u":
        args = args[1:]
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if not args or (args[0].startswith("-") and args[0] != "-m") or (args[0] == "-m" and len(args) < 2):
        return None
    return args


def main() -> None:
    line = sys.stdin.readline()
    if not line:
        return  # the launcher ended (or needed no spare): stdin closed
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    sys.path.insert(0, _LAUNCHER_DIR)  # the sibling shims: Horovod's per-rank variables, TF_CONFIG
    try:
        import _exec

        _exec.worker_env(os.environ)
    finally:
        sys.path.remove(_LAUNCHER_DIR)
    if not hasattr(sys.modules.get("phalanx"), "__file__"):
        sys.modules.pop("phalanx", None)  # _exec's bare stand-in (the preload failed): the script imports the real one
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    command = order["command"]
    args = _in_process(command)
    if args is None:
        try:
            os.execvp(command[0], command)
        except FileNotFoundError:
            sys.exit(f"phalanx: command not found: {command[0]!r} (is it on PATH in the worker's environment?)")
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == _LAUNCHER_DIR:
        sys.path.pop(0)  # (run by path) this folder's modules must not shadow anything torch imports
    _preload()
    main()
