"""Who started this process: rank, sizes and the rendezvous address from the launcher's variables.

Launchers understood, in the order they are tried::

    phalanx run / torchrun   RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR/PORT
    SLURM (srun)             SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NODEID SLURM_JOB_NODELIST
                             (an sbatch script or salloc shell, with no SLURM_STEP_ID, is not a rank)
    Open MPI (mpirun)        OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE,NODE_RANK}
    MPICH / Intel MPI (PMI)  PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS
    plain ``python x.py``    a world of one

Example::

    from phalanx.runtime.env import detect_environment
    info = detect_environment({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[07-08]"})
    info.rank, info.size, info.master_addr, info.source    # 3, 4, 'gpu07', 'slurm'
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Mapping

from phalanx.runtime.hostlist import expand_counts, expand_hostlist, node_addresses
from phalanx.settings import RuntimeSettings

__all__ = ["LaunchInfo", "PhalanxRuntimeError", "detect_environment", "expand_nodelist", "slurm_batch_only",
           "DEFAULT_PORT"]

DEFAULT_PORT = 29500


class PhalanxRuntimeError(RuntimeError):
    """Raised for a misconfigured launch environment or use before ``init()``."""


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process, before any connection is made."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    master_addr: str
    master_port: int
    source: str  # "phalanx", "torchrun", "slurm", "openmpi", "pmi" or "single"


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None or value == "":
        if default is None:
            raise PhalanxRuntimeError(f"environment variable {key} is missing; the launcher should set it")
        return default
    try:
        return int(value)
    except ValueError:
        raise PhalanxRuntimeError(f"environment variable {key}={value!r} is not an integer") from None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list: ``"gpu[01-03,07],cpu1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]``.

    The full syntax (several bracket groups, zero padding) is :func:`phalanx.runtime.hostlist.expand_hostlist`.
    """
    return expand_hostlist(nodelist)


def _port_from_job(job_id: str) -> int:
    # Every rank of one job derives the same port without talking to the others.
    digest = hashlib.sha256(job_id.encode()).digest()
    return 20000 + int.from_bytes(digest[:2], "little") % 20000


def detect_environment(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, sizes and the rendezvous address from the launcher's variables."""
    live = env is None  # this process's own environment: an MPI job may exchange rank 0's address
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun_info(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and not slurm_batch_only(env):
        return _slurm_info(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _mpi_info(
            env,
            source="openmpi",
            rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
            node_rank=env.get("OMPI_COMM_WORLD_NODE_RANK"),
            job=env.get("OMPI_MCA_orte_ess_jobid", env.get("OMPI_MCA_ess_base_jobid", "ompi")),
            live=live,
        )
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        return _mpi_info(
            env,
            source="pmi",
            rank=_int(env, "PMI_RANK"),
            size=_int(env, "PMI_SIZE"),
            local_rank=_int(env, "MPI_LOCALRANKID", 0),
            local_size=_int(env, "MPI_LOCALNRANKS", 1),
            node_rank=None,
            job=env.get("PMI_KVSNAME", env.get("PMI_ID", "pmi")),
            live=live,
        )
    return LaunchInfo(0, 1, 0, 1, 0, 1, "127.0.0.1", DEFAULT_PORT, "single")


def _torchrun_info(env: Mapping[str, str]) -> LaunchInfo:
    size = _int(env, "WORLD_SIZE")
    local_size = _int(env, "LOCAL_WORLD_SIZE", size)
    cross_size = _int(env, "GROUP_WORLD_SIZE", max(1, size // max(local_size, 1)))
    return LaunchInfo(
        rank=_int(env, "RANK"),
        size=size,
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_size=local_size,
        cross_rank=_int(env, "GROUP_RANK", 0),
        cross_size=cross_size,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", DEFAULT_PORT),
        source="phalanx" if RuntimeSettings.one("launcher", env) is not None else "torchrun",
    )


def slurm_batch_only(env: Mapping[str, str]) -> bool:
    """Inside a SLURM job but not in a step: an ``sbatch`` script or an ``salloc`` shell.

    Its SLURM_PROCID/SLURM_NTASKS describe the allocation, not this process (an ``sbatch -n4``
    script sees SLURM_PROCID=0, SLURM_NTASKS=4), so it is not one of N ranks: a plain
    ``python train.py`` there is a world of one, ``mpirun`` there is read as mpirun, and
    ``phalanx run`` there starts its workers over the allocation (``srun``).
    """
    return "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env


def _slurm_info(env: Mapping[str, str]) -> LaunchInfo:
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1")))
    size = _int(env, "SLURM_NTASKS")
    cross_size = _int(env, "SLURM_NNODES", len(nodes))
    return LaunchInfo(
        rank=_int(env, "SLURM_PROCID"),
        size=size,
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_size=_slurm_local_size(env, size, cross_size),
        cross_rank=_int(env, "SLURM_NODEID", 0),
        cross_size=cross_size,
        master_addr=env.get("MASTER_ADDR") or _slurm_first_node_addr(nodes[0], env),
        master_port=_int(env, "MASTER_PORT", _port_from_job(env.get("SLURM_JOB_ID", "slurm"))),
        source="slurm",
    )


def _slurm_first_node_addr(node: str, env: Mapping[str, str]) -> str:
    """The first node's address; SLURM's NodeAddr when its name does not resolve (inside a real job only)."""
    if "SLURM_JOB_ID" not in env:
        return node
    return node_addresses([node]).get(node, node)


def _slurm_local_size(env: Mapping[str, str], size: int, nnodes: int) -> int:
    """This node's task count: SLURM_NTASKS_PER_NODE, else this node's entry of SLURM_(STEP_)TASKS_PER_NODE."""
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if re.fullmatch(r"\d+", per_node):
        return int(per_node)
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    try:
        counts = expand_counts(text)
    except ValueError:
        counts = []
    node = _int(env, "SLURM_NODEID", 0)
    if counts:
        return counts[node] if node < len(counts) else counts[0]
    return max(1, size // max(nnodes, 1))


def _mpi_info(env, *, source, rank, size, local_rank, local_size, node_rank, job, live=False) -> LaunchInfo:
    single_host = local_size == size
    addr = env.get("MASTER_ADDR")
    if addr is None and not single_host:
        from phalanx.runtime.mpi import rank0_address

        addr = rank0_address(size) if live else None  # broadcast over MPI when mpi4py is installed
        if addr is None:
            raise PhalanxRuntimeError(
                f"{source}: a job across hosts needs rank 0's address: pip install 'phalanx[mpi]' (mpi4py) "
                "to exchange it over MPI, or pass it, e.g. `mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 …`"
            )
    addr = addr or "127.0.0.1"
    cross_rank = int(node_rank) if node_rank is not None else rank // max(local_size, 1)
    return LaunchInfo(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=max(1, size // max(local_size, 1)),
        master_addr=addr,
        master_port=_int(env, "MASTER_PORT", _port_from_job(job)),
        source=source,
    )
