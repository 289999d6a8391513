"""SLURM requeue on preemption, and automatic resume in the requeued job.

When the job holds a SLURM allocation (``$SLURM_JOB_ID``) and the signal that came is the
scheduler's early warning (``#SBATCH --signal=USR1@90``, any signal but SIGTERM), rank 0
runs ``scontrol requeue $SLURM_JOB_ID`` once every rank's checkpoint is complete; SLURM
then ends this run and puts the job back in the queue with ``SLURM_RESTART_COUNT`` one
higher, and the next run loads the newest checkpoint without any flag.

Whether to requeue (``$PHALANX_REQUEUE``, set by ``phalanx run --requeue/--no-requeue``):
``1`` always, ``0`` never, unset: when the job itself is requeueable (``scontrol show job``
says ``Requeue=1``: ``sbatch --requeue``, or the cluster's ``JobRequeue=1`` default), as
Lightning does. SIGTERM never requeues: under SLURM it means the job is already ending
(time limit, ``scancel``, or a preemption whose own mode decides about requeueing), and
``scontrol requeue`` on an ending job fails.

Example::

    from phalanx.preemption import slurm
    if slurm.requeue_wanted(signal.SIGUSR1):
        slurm.requeue()
"""

from __future__ import annotations

import os
import signal
import subprocess

from phalanx.log import get_logger
from phalanx.settings import PreemptionSettings

__all__ = ["job_id", "restarted", "requeue_wanted", "requeue"]

log = get_logger(__name__)


def job_id(env=None) -> str | None:
    """``$SLURM_JOB_ID`` (an array task has its own), or None outside SLURM."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or None


def restarted(env=None) -> bool:
    """True in a job SLURM requeued (``SLURM_RESTART_COUNT`` > 0): resume from the newest checkpoint."""
    env = os.environ if env is None else env
    try:
        return int(env.get("SLURM_RESTART_COUNT", "0") or 0) > 0
    except ValueError:
        return False


def _requeueable(job: str) -> bool:
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("cannot ask SLURM whether job %s is requeueable (%s); not requeueing", job, err)
        return False
    return "Requeue=1" in out.split()


def requeue_wanted(sig: signal.Signals | None, env=None) -> bool:
    """Whether this preemption should requeue the SLURM job (see the module docstring)."""
    env = os.environ if env is None else env
    job = job_id(env)
    mode = PreemptionSettings.one("requeue", env)
    if job is None or sig is None or sig == signal.SIGTERM or mode in ("0", "false", "no"):
        return False
    return mode in ("1", "true", "yes") or _requeueable(job)


def requeue(env=None) -> bool:
    """Run ``scontrol requeue <job>``; True when SLURM accepted it (a refusal is logged, not raised)."""
    job = job_id(env)
    if job is None:
        return False
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("scontrol requeue %s failed to run: %s", job, err)
        return False
    if done.returncode < 0:  # a signal ended it: SLURM, stopping this job's processes as it requeues the job
        log.warning("requeued SLURM job %s (scontrol was ended by signal %d as SLURM stopped the job's processes): "
                    "it resumes from the preemption checkpoint when it runs again", job, -done.returncode)
        return True
    if done.returncode != 0:
        log.warning("scontrol requeue %s refused: %s", job, (done.stderr or done.stdout).strip())
        return False
    log.warning("requeued SLURM job %s: it resumes from the preemption checkpoint when it runs again", job)
    return True
